"""Torch-native CPU stand-ins for the sgl_kernel.kvcacheio transfer ops.

tiered_kv's copy of ../shared/peer/stubs/peer_kvcacheio_cpu.py, extended: install() also binds
the MLA host pool's ops (pool_host/mla.py), with stand-ins for its two page_first kernel ops
(transfer_kv_all_layer_mla_lf_pf / transfer_kv_per_layer_mla_pf_lf).

Why: on a machine without CUDA/ROCm/XPU, sglang 0.5.23's host pools
(sglang/srt/mem_cache/pool_host/mha.py) never import the transfer ops at all
(the `from sgl_kernel.kvcacheio import ...` sits under `if _is_cuda or _is_hip`),
so MHATokenToKVPoolHost.backup_from_device_all_layer / load_to_device_per_layer
die with NameError.  `install()` binds the functions below into that module's
namespace under the names SGLang calls.

The "direct" ops follow the algorithm of sgl-kernel/csrc/kvcacheio/transfer.cu
(transfer_kv_direct, transfer_kv_page_first_direct_impl): indices are moved to
the CPU, contiguous runs (or whole pages) are located, and each run/page is
moved with one Tensor.copy_ per layer per K/V.  In the original that loop is
C++ calling ATen; here it is a Python loop calling the same ATen copy_, so it
carries an extra ~1 us of interpreter overhead per copy.

The "kernel" ops (transfer_kv_all_layer_lf_pf / transfer_kv_per_layer_pf_lf),
which on GPU are CUDA kernels that walk a uint64 table of layer pointers, are
emulated with one gather+scatter (advanced indexing) per layer; the pointer
table is resolved back to tensors through `register_tensors`.
"""
from __future__ import annotations

from typing import List, Sequence

import torch

__sglang_peer_stub__ = True

# ---------------------------------------------------------------- direct ops


def _runs(src_idx: torch.Tensor, dst_idx: torch.Tensor):
    """(src_start, dst_start, length) for maximal runs where both index
    sequences step by +1 -- same segmentation as the C++ loop."""
    s = src_idx.to("cpu", torch.int64)
    d = dst_idx.to("cpu", torch.int64)
    n = s.numel()
    if n == 0:
        return []
    brk = ((s[1:] - s[:-1]) != 1) | ((d[1:] - d[:-1]) != 1)
    ends = torch.nonzero(brk).flatten().add_(1).tolist() + [n]
    starts = [0] + ends[:-1]
    sl, dl = s.tolist(), d.tolist()
    return [(sl[a], dl[a], b - a) for a, b in zip(starts, ends)]


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: List[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
):
    assert len(src_layers) == len(dst_layers)
    assert src_indices.numel() == dst_indices.numel()
    assert page_size > 0 and src_indices.numel() % page_size == 0
    for s, d, n in _runs(src_indices, dst_indices):
        for src, dst in zip(src_layers, dst_layers):
            dst[d : d + n].copy_(src[s : s + n])


def _page_first_direct(src_ptrs, dst_ptrs, src_indices, dst_indices, start_layer_id, page_size, lf2pf):
    assert src_indices.numel() == dst_indices.numel()
    assert page_size > 0 and src_indices.numel() % page_size == 0
    s_first = src_indices.to("cpu", torch.int64)[::page_size].tolist()
    d_first = dst_indices.to("cpu", torch.int64)[::page_size].tolist()
    if lf2pf:  # device (layer-first, list of per-layer tensors) -> host page_first_direct
        is_mla = len(dst_ptrs) == 1
        num_layers = len(src_ptrs) if is_mla else len(src_ptrs) // 2
        for s, d in zip(s_first, d_first):
            dp = d // page_size
            for j in range(num_layers):
                dst_ptrs[0][dp, start_layer_id + j].copy_(src_ptrs[j][s : s + page_size])
                if not is_mla:
                    dst_ptrs[1][dp, start_layer_id + j].copy_(
                        src_ptrs[j + num_layers][s : s + page_size]
                    )
    else:  # host page_first_direct -> device (one layer)
        is_mla = len(src_ptrs) == 1
        num_layers = len(dst_ptrs) if is_mla else len(dst_ptrs) // 2
        for s, d in zip(s_first, d_first):
            sp = s // page_size
            for j in range(num_layers):
                dst_ptrs[j][d : d + page_size].copy_(src_ptrs[0][sp, start_layer_id + j])
                if not is_mla:
                    dst_ptrs[j + num_layers][d : d + page_size].copy_(
                        src_ptrs[1][sp, start_layer_id + j]
                    )


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    _page_first_direct(src_ptrs, dst_ptrs, src_indices, dst_indices, 0, page_size, True)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    _page_first_direct(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size, False)


# ---------------------------------------------------------------- kernel ops
_PTR2TENSOR: dict[int, torch.Tensor] = {}


def register_tensors(tensors):
    """Make data_ptr() -> tensor resolvable for the pointer-table ops."""
    for t in tensors:
        _PTR2TENSOR[int(t.data_ptr())] = t


def _resolve(table: torch.Tensor) -> List[torch.Tensor]:
    return [_PTR2TENSOR[int(p)] for p in table.tolist()]


def transfer_kv_all_layer_lf_pf(src_k_layers, dst_k, src_v_layers, dst_v, src_indices,
                                dst_indices, item_size, dst_layout_dim, num_layers, **_):
    # dst_k / dst_v: host page_first buffers [size, layer, head, dim]
    ks, vs = _resolve(src_k_layers), _resolve(src_v_layers)
    si, di = src_indices.long(), dst_indices.long()
    for l in range(num_layers):
        dst_k[di, l] = ks[l][si]
        dst_v[di, l] = vs[l][si]


def transfer_kv_per_layer_pf_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices,
                                layer_id, item_size, src_layout_dim, **_):
    si, di = src_indices.long(), dst_indices.long()
    dst_k[di] = src_k[si, layer_id]
    dst_v[di] = src_v[si, layer_id]


def transfer_kv_all_layer(src_k_layers, dst_k_layers, src_v_layers, dst_v_layers,
                          src_indices, dst_indices, item_size, num_layers, **_):
    si, di = src_indices.long(), dst_indices.long()
    for s, d in zip(_resolve(src_k_layers) + _resolve(src_v_layers),
                    _resolve(dst_k_layers) + _resolve(dst_v_layers)):
        d[di] = s[si]


def transfer_kv_per_layer(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size, **_):
    si, di = src_indices.long(), dst_indices.long()
    dst_k[di] = src_k[si]
    dst_v[di] = src_v[si]


def transfer_kv_all_layer_mla_lf_pf(src_layers, dst, src_indices, dst_indices, item_size,
                                    dst_layout_dim, num_layers, **_):
    # dst: the MLA host page_first buffer [size, layer, 1, dim]
    si, di = src_indices.long(), dst_indices.long()
    for l, src in enumerate(_resolve(src_layers)[:num_layers]):
        dst[di, l] = src[si]


def transfer_kv_per_layer_mla_pf_lf(src, dst, src_indices, dst_indices, layer_id, item_size,
                                    src_layout_dim, **_):
    si, di = src_indices.long(), dst_indices.long()
    dst[di] = src[si, layer_id]


_MLA_OPS = [
    "transfer_kv_direct",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_per_layer_mla_pf_lf",
]

_OPS = [
    "transfer_kv_direct",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_all_layer",
    "transfer_kv_per_layer",
]


def install():
    """Bind the ops into sglang.srt.mem_cache.pool_host.mha and .mla (only where unbound)."""
    import sglang.srt.mem_cache.pool_host.mha as mha
    import sglang.srt.mem_cache.pool_host.mla as mla

    bound = []
    for module, ops in ((mha, _OPS), (mla, _MLA_OPS)):
        for name in ops:
            if not hasattr(module, name):
                setattr(module, name, globals()[name])
                bound.append(f"{module.__name__.rsplit('.', 1)[-1]}.{name}")
    return bound
