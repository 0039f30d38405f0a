"""Every slot accounted for: what a cache manager's pools have free, its tree holds and its
callers hold adds up to what was free when the manager was built.

Device and host tokens are counted on the side that holds every token (a sliding-window pool's
full side). A sliding-window pool is also checked where a wrong count would serve wrong KV:
every device-resident node not marked windowless has a window slot for each of its tokens (a
node that lost them and still counted as whole would be read from the padding slot).
"""

from __future__ import annotations

import torch

from tiered_kv.errors import IntegrityError


def free_device_tokens(device) -> int:
    """Free device slots on the side that holds every token: a unified sliding-window
    allocator's free virtual ids, a sliding-window allocator's full side, a HiSparse
    allocator's device side, else the pool's."""
    for name in ("virtual_available_size", "full_available_size", "device_available_size"):
        count = getattr(device, name, None)
        if count is not None:
            return count()
    return device.available_size()


def check_slots(manager, outside_device: int, outside_host: int) -> None:
    tree, device = manager.tree, manager.device
    free = free_device_tokens(device)
    tiers = [("device", free, tree.device_tokens, outside_device, manager._device0)]
    if manager.host is not None:
        free_host = manager.host.available_size()
        tiers.append(("host", free_host, tree.host_tokens, outside_host, manager._host0))
    for name, free, in_tree, outside, total in tiers:
        if free + in_tree + outside != total:
            raise IntegrityError(
                f"{name} slots leaked or double counted: {free} free + {in_tree} in tree + "
                f"{outside} held outside != {total} at construction"
            )
    if manager.window is not None:
        _check_window(manager)


def _check_window(manager) -> None:
    to_window = manager.device.translate_loc_from_full_to_swa
    for n in manager.tree.nodes():
        if n.on_device and not n.windowless and not n.stale:
            missing = to_window(n.device.to(torch.int64)) <= 0
            if bool(missing.any()):
                raise IntegrityError(
                    f"{n!r} is not marked windowless but {int(missing.sum())} of its tokens "
                    "have no window slot (their window KV would be read from the padding slot)"
                )
