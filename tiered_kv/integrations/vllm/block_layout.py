"""vLLM's per-layer KV cache tensors seen as rows of whole blocks, and the namespace of their pages.

vLLM 0.32 hands every attention layer's cache as a logical ``[blocks, heads, block_size,
content]`` view (``content``: K then V of one head, ``2 * head_size``; one latent row for MLA,
``heads == 1``) whose physical order is the backend's ``KVCacheLayout``: the CPU backend's is
``LBHNC`` (per layer ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``; inside a block
and head the K rows, then the V rows), FlashAttention's ``LBNHC`` (``[num_blocks, block_size,
num_kv_heads, 2 * head_size]``). Older CUDA backends keep K and V in two planes of one tensor,
``[2, num_blocks, block_size, num_kv_heads, head_size]``. In each of these a block of one layer
(of one plane) is one contiguous run, and runs of consecutive blocks are packed: that is what
tiered_kv's page-transfer launchers copy, one row per block (``part`` = plane). A layout whose
blocks are strided through memory (layer-interleaved ``BLHNC``, head-outermost ``LHBNC``) is
refused by name at registration.

A stored page is one block of every layer in physical order; the layout's name, the parts, the
dtype, the block size and the layers are the namespace, so pages of two layouts never meet.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.integrations.vllm.groups import GroupKind
from tiered_kv.storage.keys import StorageNamespace

_LOGICAL = "BHNC"  # vLLM's logical per-layer axes: blocks, heads, tokens in block, content
_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


@dataclass(frozen=True)
class BlockLayout:
    """How one engine's KV blocks lie: per layer, per part, a ``[num_blocks, row]`` tensor
    (``rows[p][l]``), and what a page of them is."""

    layer_names: tuple[str, ...]
    layer_ids: tuple[int, ...]
    rows: tuple[tuple[torch.Tensor, ...], ...]  # [part][layer] -> (num_blocks, row elements)
    layout: str
    heads: int
    block_size: int
    content: int
    dtype: torch.dtype
    kind: str = "vllm-attention"  # vllm-window, vllm-state: another group kind, other pages

    @property
    def num_blocks(self) -> int:
        return int(self.rows[0][0].shape[0])

    @property
    def row_elems(self) -> int:
        return int(self.rows[0][0].shape[1])

    @property
    def num_parts(self) -> int:
        return len(self.rows)

    @property
    def page_nbytes(self) -> int:
        """Bytes of one stored page: one block of every layer and part."""
        return (
            len(self.layer_ids) * self.num_parts * self.row_elems * self.rows[0][0].element_size()
        )

    def namespace(
        self,
        *,
        model: str,
        rank: str | None,
        tenant: str | None,
        kv_scales: str | None,
        kv_cache_dtype: str | None = None,
    ) -> StorageNamespace:
        """The pages' namespace; ``kv_cache_dtype``: vLLM's ``--kv-cache-dtype`` where it is not
        ``auto`` (a quantized cache may be stored in a plain integer dtype)."""
        dtype = str(self.dtype)
        if kv_cache_dtype not in (None, "auto"):
            dtype = f"{dtype}:{kv_cache_dtype}"
        per_token = (self.heads, self.content)
        parts = [("kv", per_token)] if self.num_parts == 1 else [("k", per_token), ("v", per_token)]
        return StorageNamespace.create(
            kind=self.kind,
            parts=parts,
            dtype=dtype,
            layer_ids=self.layer_ids,
            page_size=self.block_size,
            layout=self.layout,
            tenant=tenant,
            model=model,
            rank=rank,
            kv_scales=kv_scales,
        )


def physical_order(view: torch.Tensor) -> str:
    """The logical axes of a 4-D ``[B, H, N, C]`` view in memory order, outermost first (e.g.
    ``BHNC``), when the view is dense; else InvalidArgumentError."""
    if view.dim() != 4:
        raise InvalidArgumentError(f"a layer's KV view has shape {tuple(view.shape)}; expected 4-D")
    # Ties come only from size-1 axes (their stride is arbitrary): the logical order breaks
    # them, so blocks stay outermost (a contiguous [B, 1, N, C] with one KV head per rank).
    order = sorted(range(4), key=lambda d: (-view.stride(d), d))
    expect = 1
    for d in reversed(order):  # innermost first: each stride the product of those inside it
        if view.shape[d] != 1 and view.stride(d) != expect:
            raise InvalidArgumentError(
                f"a layer's KV view of shape {tuple(view.shape)} has strides {view.stride()}: "
                "not dense, so its blocks are not runs of memory"
            )
        expect *= view.shape[d]
    return "".join(_LOGICAL[d] for d in order)


def _block_rows(view: torch.Tensor, name: str) -> tuple[torch.Tensor, str]:
    order = physical_order(view)
    if order[0] != "B":
        raise InvalidArgumentError(
            f"layer {name!r}: KV layout L{order} keeps a block's bytes apart (blocks are not the "
            "outermost axis); the connector copies block-outermost layouts (LBHNC, LBNHC): use "
            "an attention backend with one of those, or the legacy [2, blocks, ...] planes"
        )
    per_block = math.prod(view.shape[1:])
    rows = torch.as_strided(view, (view.shape[0], per_block), (per_block, 1))
    return rows, "L" + order


def _layer_id(name: str, position: int) -> int:
    found = _LAYER_INDEX.findall(name)
    return int(found[0]) if found else position


def describe_layers(kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> BlockLayout:
    """The block rows of every layer vLLM registered (``kv_caches``: layer name -> cache), in
    layer order (the dict's order where names carry no distinct layer index). Each cache is a
    ``[num_blocks, H, N, C]`` view or legacy planes ``[2, num_blocks, N, H, D]``; every layer
    must have the same shape, dtype and layout."""
    if not kv_caches:
        raise InvalidArgumentError("register_kv_caches got no layers: nothing to store")
    ids = [_layer_id(n, i) for i, n in enumerate(kv_caches)]
    if len(set(ids)) == len(ids):  # pages hold layers in layer order, whatever the dict's
        kv_caches = dict(sorted(kv_caches.items(), key=lambda kv: _layer_id(kv[0], 0)))
    names, parts_per_layer, layouts, shapes = [], [], set(), set()
    for name, cache in kv_caches.items():
        if not isinstance(cache, torch.Tensor):
            raise InvalidArgumentError(f"layer {name!r}: KV cache is a {type(cache).__name__}")
        ratio = cache.shape[0] // num_blocks if cache.dim() == 4 and num_blocks > 0 else 0
        if cache.dim() == 4 and ratio >= 1 and cache.shape[0] == ratio * num_blocks:
            # ``ratio`` > 1: the attention kernel splits each of vLLM's blocks into ``ratio``
            # kernel blocks, consecutive in memory (block-outermost layouts): one row each.
            rows, layout = _block_rows(cache, name)
            if ratio > 1:
                rows, layout = rows.reshape(num_blocks, -1), f"{layout}x{ratio}"
            h, n, c = cache.shape[1:]
            parts, logical = (rows,), (h, n * ratio, c)
        elif cache.dim() == 5 and cache.shape[0] == 2 and cache.shape[1] == num_blocks:
            # legacy planes [2, B, N, H, D]: K plane then V plane, each [B, N, H, D]
            k, v = (_block_rows(cache[i].permute(0, 2, 1, 3), name) for i in (0, 1))
            parts, layout = (k[0], v[0]), "KV2-" + k[1]
            logical = (cache.shape[3], cache.shape[2], cache.shape[4])
        else:
            raise InvalidArgumentError(
                f"layer {name!r}: KV cache of shape {tuple(cache.shape)} is neither "
                f"[{num_blocks} blocks, heads, block_size, content] nor [2, {num_blocks} blocks, "
                "block_size, heads, head_size]"
            )
        names.append(name)
        parts_per_layer.append(parts)
        layouts.add(layout)
        shapes.add((logical, cache.dtype, cache.device))
    if len(layouts) != 1 or len(shapes) != 1:
        raise InvalidArgumentError(
            f"layers differ in layout {sorted(layouts)} or shape/dtype/device "
            f"{sorted(map(str, shapes))}: the connector stores one page geometry per engine"
        )
    (heads, block_size, content), dtype, _ = shapes.pop()
    return _layout(names, parts_per_layer, layouts.pop(), heads, block_size, content, dtype)


def _layout(names, parts_per_layer, layout, heads, block_size, content, dtype, kind=None):
    ids = tuple(_layer_id(n, i) for i, n in enumerate(names))
    if len(set(ids)) != len(ids):
        ids = tuple(range(len(names)))
    rows = tuple(tuple(p[i] for p in parts_per_layer) for i in range(len(parts_per_layer[0])))
    return BlockLayout(
        layer_names=tuple(names),
        layer_ids=ids,
        rows=rows,
        layout=layout,
        heads=int(heads),
        block_size=int(block_size),
        content=int(content),
        dtype=dtype,
        kind=kind or "vllm-attention",
    )


def state_rows(cache: torch.Tensor, num_blocks: int, name: str) -> torch.Tensor:
    """A recurrent-state layer's blocks as ``[num_blocks, page bytes]`` int8 rows: vLLM hands
    its state as a raw ``[num_blocks, 1, 1, state bytes]`` int8 view whose blocks are a padded
    page apart; a row is the whole padded page (the padding belongs to the block too)."""
    if cache.dim() != 4 or cache.shape[0] != num_blocks or cache.dtype != torch.int8:
        raise InvalidArgumentError(
            f"layer {name!r}: recurrent state of shape {tuple(cache.shape)} {cache.dtype}; "
            f"expected vLLM's raw int8 pages [{num_blocks}, 1, 1, bytes]"
        )
    page = cache.stride(0)
    inner = math.prod(cache.shape[1:])
    end = cache.storage_offset() + num_blocks * page
    if page < inner or end > cache.untyped_storage().nbytes() or cache.stride(3) != 1:
        raise InvalidArgumentError(
            f"layer {name!r}: recurrent state of shape {tuple(cache.shape)} strides "
            f"{cache.stride()} is not one run of {num_blocks} pages"
        )
    return torch.as_strided(cache, (num_blocks, page), (page, 1))


def describe_groups(kv_caches, kv_cache_config, grid, num_blocks: int) -> dict[int, BlockLayout]:
    """Per KV cache group with layers on this rank, the layout of its layers' blocks (its
    layers: the group's ``layer_names`` that ``kv_caches`` holds; a layer sharing another's
    cache is in no group and is not stored twice). Attention groups as ``describe_layers``;
    state groups as raw padded pages (``state_rows``), their spec's shapes and dtypes in the
    layout's name."""
    out = {}
    for plan, group in zip(grid.groups, kv_cache_config.kv_cache_groups, strict=True):
        names = [n for n in group.layer_names if n in kv_caches]
        if not names:
            continue  # a pipeline stage without this group's layers
        kind = {GroupKind.FULL: "vllm-attention", GroupKind.WINDOW: "vllm-window"}.get(
            plan.kind, "vllm-state"
        )
        if plan.kind is not GroupKind.STATE:
            layout = describe_layers({n: kv_caches[n] for n in names}, num_blocks)
            out[plan.index] = dataclasses.replace(layout, kind=kind)
            continue
        spec = group.kv_cache_spec
        rows = [state_rows(kv_caches[n], num_blocks, n) for n in names]
        what = f"RAW{tuple(map(tuple, spec.shapes))}{tuple(str(d) for d in spec.dtypes)}"
        out[plan.index] = _layout(
            names, [(r,) for r in rows], what.replace(" ", ""), 1, plan.block_size,
            rows[0].shape[1], torch.int8, kind,
        )  # fmt: skip
    return out
