"""Native page-transfer launcher (CPU): one call of the C block copier for a whole transfer.

Block addresses are computed with torch ops, in destination order (token-major when the host
layout keeps a token's layers together), so each copier thread writes a nearly sequential stream.
Large transfers use several threads and non-temporal stores. Same contract as
``transfer_reference.transfer_rows``; the caller has validated every index.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from tiered_kv.kernels import native_build

# Below these sizes a thread start or a cache bypass costs more than it saves.
THREADS_MIN_BYTES = 1 << 20
STREAM_MIN_BYTES = 8 << 20


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
    n = dev_rows.numel()
    if n == 0:
        return
    lib = native_build.load()
    if lib is None:
        raise RuntimeError(native_build.error())
    elt = host.element_size()
    host_addr = host.data_ptr() + host_offsets.to(torch.int64) * elt  # (L, n)
    dev_addrs, host_addrs, row_bytes = [], [], []
    for bufs, part_off in zip(dev_buffers, part_offsets, strict=True):
        nbytes = bufs[0].numel() // bufs[0].shape[0] * elt
        bases = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
        dev_addrs.append(bases[:, None] + dev_rows.to(torch.int64)[None, :] * nbytes)
        host_addrs.append(host_addr + part_off * elt)
        row_bytes.append(nbytes)
    dev = torch.stack(dev_addrs, dim=-1)  # (L, n, parts)
    hst = torch.stack(host_addrs, dim=-1)
    sizes = None
    if len(set(row_bytes)) > 1:
        sizes = torch.tensor(row_bytes, dtype=torch.int64).expand_as(dev)
    if to_host and token_major:
        dev, hst = dev.transpose(0, 1), hst.transpose(0, 1)
        sizes = sizes.transpose(0, 1) if sizes is not None else None
    dst, src = (hst, dev) if to_host else (dev, hst)
    dst, src = dst.reshape(-1).contiguous(), src.reshape(-1).contiguous()
    sizes = sizes.reshape(-1).contiguous() if sizes is not None else None
    total = n * host_offsets.shape[0] * sum(row_bytes)
    threads = torch.get_num_threads() if total >= THREADS_MIN_BYTES else 1
    rc = lib.tkv_copy_blocks(
        ctypes.c_void_p(dst.data_ptr()),
        ctypes.c_void_p(src.data_ptr()),
        ctypes.c_void_p(sizes.data_ptr() if sizes is not None else 0),
        dst.numel(),
        row_bytes[0],
        max(1, threads),
        int(total >= STREAM_MIN_BYTES),
    )
    if rc != 0:
        raise RuntimeError(f"native block copier refused the transfer (rc={rc})")
