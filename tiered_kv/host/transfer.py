"""Page transfers between a device pool and a host pool: validation and the two io backends.

- ``"kernel"``: every (part, layer, token) row in one backend call (Triton on CUDA, the native
  block copier on CPU, or the torch reference), any index pattern.
- ``"direct"``: host indices sorted first, runs where host and device indices are both
  consecutive merged, one ``copy_(..., non_blocking=True)`` per (run, part, layer). Best when
  pages are large and runs long; both backends give identical bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from tiered_kv._checks import check_index_tensor, check_range
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.host.layout import HostLayout

IO_BACKENDS = ("kernel", "direct")
_CPU = torch.device("cpu")


def check_io_backend(io_backend: str) -> str:
    if io_backend not in IO_BACKENDS:
        raise InvalidArgumentError(
            f"io_backend={io_backend!r} is not an io backend; use one of {list(IO_BACKENDS)}"
        )
    return io_backend


# Up to this many indices the checks run on a Python list (one ``tolist``, then min, max and a
# set) instead of torch reductions and ``torch.unique`` (~3-12 us fixed per call each, paid for
# both index tensors of every transfer op).
_SET_UNIQUE_MAX = 512


def _check_unique(name: str, idx: torch.Tensor) -> None:
    if idx.numel() <= _SET_UNIQUE_MAX and len(set(idx.tolist())) == idx.numel():
        return
    uniq, counts = torch.unique(idx, return_counts=True)
    if uniq.numel() != idx.numel():
        repeated = uniq[counts > 1][:8].tolist()
        raise InvalidArgumentError(f"{name} repeat slots {repeated}; each slot moves once")


def _check_values(name: str, idx: torch.Tensor, low: int, high: int) -> None:
    """Every value in [low, high) and none repeated (CPU tensors)."""
    n = idx.numel()
    if n == 0 or n > _SET_UNIQUE_MAX:
        check_range(name, idx, low, high)
        _check_unique(name, idx)
        return
    values = idx.tolist()
    if min(values) < low or max(values) >= high:
        check_range(name, idx, low, high)  # raises, naming the values
    if len(set(values)) != n:
        _check_unique(name, idx)  # raises, naming the repeats


class TransferPlan(NamedTuple):
    host: torch.Tensor  # int64, CPU
    device: torch.Tensor  # int64, on the device, already translated to physical slots


def plan_transfer(
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    *,
    host_size: int,
    device: torch.device,
    device_low: int,
    device_high: int,
    validate_device_values: bool,
    where: str,
) -> TransferPlan:
    """Check a transfer's indices (same length, ranges, no repeated destination) and return
    them as int64. Raises InvalidArgumentError and changes nothing on bad input."""
    check_index_tensor(f"{where}: host_indices", host_indices, _CPU)
    check_index_tensor(f"{where}: device_indices", device_indices, device)
    if host_indices.shape[0] != device_indices.shape[0]:
        raise InvalidArgumentError(
            f"{where}: host_indices has {host_indices.shape[0]} entries and device_indices "
            f"{device_indices.shape[0]}; they pair up one to one"
        )
    host = host_indices.to(torch.int64)
    _check_values(f"{where}: host_indices", host, 0, host_size)
    dev = device_indices.to(torch.int64)
    if validate_device_values:
        if dev.device.type == "cpu":
            _check_values(f"{where}: device_indices", dev, device_low, device_high)
        else:
            check_range(f"{where}: device_indices", dev, device_low, device_high)
            _check_unique(f"{where}: device_indices", dev)
    return TransferPlan(host, dev)


def direct_runs(
    plan: TransferPlan, layout: HostLayout, page_size: int
) -> list[tuple[int, int, int]]:
    """(host start, device start, length) of the runs where host and device slots are both
    consecutive, host-sorted; in ``page_first_direct`` a run also ends at a host page boundary."""
    if plan.host.numel() == 0:
        return []
    order = torch.argsort(plan.host)
    h = plan.host[order]
    d = plan.device.to(_CPU)[order]
    breaks = (h[1:] != h[:-1] + 1) | (d[1:] != d[:-1] + 1)
    if layout is HostLayout.PAGE_FIRST_DIRECT:
        breaks |= h[1:] % page_size == 0  # a slice of this layout stays inside one page
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.nonzero(breaks)[:, 0] + 1])
    lengths = torch.diff(torch.cat([starts, torch.tensor([h.numel()])]))
    return list(zip(h[starts].tolist(), d[starts].tolist(), lengths.tolist(), strict=True))


def direct_copy(
    dev_buffers: Sequence[Sequence[torch.Tensor]],
    host_views: Sequence[torch.Tensor],
    layers: Sequence[int],
    runs: list[tuple[int, int, int]],
    layout: HostLayout,
    page_size: int,
    to_host: bool,
) -> None:
    """The ``"direct"`` backend. ``dev_buffers[p][j]`` is part p of local layer ``layers[j]``;
    ``host_views[p]`` is part p's host view (``layout.part_view``)."""
    paged = layout is HostLayout.PAGE_FIRST_DIRECT
    for bufs, view in zip(dev_buffers, host_views, strict=True):
        for buf, layer in zip(bufs, layers, strict=True):
            hv = view[layer]
            for h0, d0, n in runs:
                if paged:
                    off = h0 % page_size
                    host_part = hv[h0 // page_size, off : off + n]
                else:
                    host_part = hv[h0 : h0 + n]
                dev_part = buf[d0 : d0 + n]
                if to_host:
                    host_part.copy_(dev_part, non_blocking=True)
                else:
                    dev_part.copy_(host_part, non_blocking=True)
