"""Torch reference of the page-transfer launchers (same signature in every backend).

A transfer copies, for every part p, layer l and token i, one row of ``e_p`` elements between
row ``dev_rows[i]`` of the device buffer ``dev_buffers[p][l]`` and the host record at element
offset ``host_offsets[l, i] + part_offsets[p]`` of ``host``. Rows are copied as integers of the
same width, so every bit (NaN payloads included) survives. Like the kernels it trusts the caller
(the host pool validated every index).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
    token_major: bool = False,
) -> None:
    """Copy rows device -> host (``to_host``) or host -> device. ``token_major`` is a hint for
    the native path's copy order and ignored here."""
    del token_major
    if dev_rows.numel() == 0:
        return
    flat = as_int(host).view(-1)
    for bufs, part_off in zip(dev_buffers, part_offsets, strict=True):
        for layer, buf in enumerate(bufs):
            rows = as_int(buf).view(buf.shape[0], -1)
            cols = torch.arange(rows.shape[1], device=flat.device)
            idx = (host_offsets[layer].to(flat.device) + part_off)[:, None] + cols
            drows = dev_rows.to(rows.device)
            if to_host:
                flat[idx] = rows[drows].to(flat.device)
            else:
                rows[drows] = flat[idx].to(rows.device)
