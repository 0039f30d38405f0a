"""Torch reference of the page-transfer launchers (same signature in every backend).

A transfer copies, for every part p, chosen layer l and token i, one row of ``e_p`` elements
between row ``dev_rows[i]`` of the device buffer ``dev_buffers[p][l]`` and the host record at
element offset ``host_offsets[l, i] + part_offsets[p]`` of ``host``. ``dev_buffers`` and
``host_offsets`` cover every local layer; ``layers`` picks the ones copied (None: all). Rows are
copied as integers of the same width, so every bit (NaN payloads included) survives. Like the
kernels it trusts the caller (the host pool validated every index).

:class:`PlanCache` is the one piece of state a launcher may keep between calls: the caller owns
it and passes the same one to every call of one transfer (the calls of a layer-wise load).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class PlanCache:
    """What a launcher keeps between the calls of one transfer; opaque to the caller.

    Every backend accepts one; a backend with nothing worth keeping ignores it (torch, Triton).
    A backend that keeps something (the native copier's block addresses) checks on every call
    that it was built from the same arguments (the same tensor objects, the index tensors
    unmodified by ``_version``) and rebuilds it otherwise: a stale cache costs time, never
    bytes. Dropping the cache releases what it holds."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: dict[object, object] = {}


def as_int(t: torch.Tensor) -> torch.Tensor:
    """The same bytes viewed as integers of the element's width (bit-exact copies)."""
    return t.view(_INT_OF_WIDTH[t.element_size()])


def transfer_rows(
    dev_buffers: Sequence[Sequence[torch.Tensor]],
    host: torch.Tensor,
    dev_rows: torch.Tensor,
    host_offsets: torch.Tensor,
    part_offsets: Sequence[int],
    to_host: bool,
    *,
    layers: Sequence[int] | None = None,
    token_major: bool = False,
    plan_cache: PlanCache | None = None,
) -> None:
    """Copy rows device -> host (``to_host``) or host -> device. ``token_major`` (a hint for the
    native copy order) and ``plan_cache`` are accepted and ignored here."""
    del token_major, plan_cache
    if dev_rows.numel() == 0:
        return
    flat = as_int(host).view(-1)
    chosen = range(len(dev_buffers[0])) if layers is None else layers
    for bufs, part_off in zip(dev_buffers, part_offsets, strict=True):
        for layer in chosen:
            buf = bufs[layer]
            rows = as_int(buf).view(buf.shape[0], -1)
            cols = torch.arange(rows.shape[1], device=flat.device)
            idx = (host_offsets[layer].to(flat.device) + part_off)[:, None] + cols
            drows = dev_rows.to(rows.device)
            if to_host:
                flat[idx] = rows[drows].to(flat.device)
            else:
                rows[drows] = flat[idx].to(rows.device)
