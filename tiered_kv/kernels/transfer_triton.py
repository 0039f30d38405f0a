"""Triton page-transfer kernel and launcher: copy rows between device buffers and host memory.

Import only through :func:`tiered_kv.kernels.transfer_kernels`. On CUDA the host buffer is
pinned (registered) memory, which the kernel reads and writes directly over UVA; on CPU the
kernel runs under the interpreter (tests). One program copies one row; rows are moved as
integers of the element width, so the copy is bit-exact whatever the dtype (fp8 is uint8).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.kernels.transfer_reference import PlanCache, as_int


@triton.jit
def copy_rows_kernel(
    src_ptr,
    src_off_ptr,
    dst_ptr,
    dst_off_ptr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    src_start = tl.load(src_off_ptr + pid)
    dst_start = tl.load(dst_off_ptr + pid)
    for start in range(0, ROW, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < ROW
        row = tl.load(src_ptr + src_start + cols, mask=mask)
        tl.store(dst_ptr + dst_start + cols, row, mask=mask)


def copy_rows(
    src: torch.Tensor, src_off: torch.Tensor, dst: torch.Tensor, dst_off: torch.Tensor, row: int
) -> None:
    """Launch :func:`copy_rows_kernel`: row i copies ``row`` elements from src to dst."""
    n = src_off.numel()
    if n == 0:
        return
    if src_off.numel() != dst_off.numel() or src_off.dtype != torch.int64:
        raise InvalidArgumentError(
            f"src_off has {src_off.numel()} {src_off.dtype} entries and dst_off "
            f"{dst_off.numel()} {dst_off.dtype}; both must be int64 tensors of equal length"
        )
    block = min(triton.next_power_of_2(row), 1024)
    copy_rows_kernel[(n,)](src, src_off, dst, dst_off, ROW=row, BLOCK=block)


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
    """One launch per (part, chosen layer); see ``transfer_reference.transfer_rows`` for the
    contract (``token_major`` and ``plan_cache`` are ignored)."""
    del token_major, plan_cache
    if dev_rows.numel() == 0:
        return
    device = dev_buffers[0][0].device
    flat_host = as_int(host).view(-1)
    chosen = list(range(len(dev_buffers[0]))) if layers is None else list(layers)
    # Only the chosen layers' offsets go to the device: one layer of a layer-wise load moves n.
    offsets = (host_offsets if layers is None else host_offsets[chosen]).to(device)
    for bufs, part_off in zip(dev_buffers, part_offsets, strict=True):
        row = bufs[0].numel() // bufs[0].shape[0]
        dev_off = dev_rows.to(device, torch.int64) * row
        for j, layer in enumerate(chosen):
            flat_dev = as_int(bufs[layer]).view(-1)
            host_off = (offsets[j] + part_off).contiguous()
            if to_host:
                copy_rows(flat_dev, dev_off, flat_host, host_off, row)
            else:
                copy_rows(flat_host, host_off, flat_dev, dev_off, row)
