"""Helpers of the vLLM connector's tests: per-layer KV caches in each of vLLM's block layouts,
filled with random bits (NaN payloads included), and the bytes a block or a page must hold."""

from __future__ import annotations

import random

import torch

from tiered_kv.integrations.vllm.block_layout import BlockLayout

KINDS = ("LBHNC", "LBNHC", "KV2")  # the CPU backend's, FlashAttention's, legacy K/V planes
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fill_bits_(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random bits in every element of the contiguous ``t`` (any float pattern: NaNs, infs)."""
    ints = t.view(_INT_OF_WIDTH[t.element_size()])
    info = torch.iinfo(ints.dtype)
    ints.copy_(torch.randint(info.min, info.max, ints.shape, generator=gen, dtype=torch.int64))
    return t


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def make_caches(
    kind: str,
    layer_ids,
    num_blocks: int,
    heads: int,
    block_size: int,
    head_size: int,
    gen: torch.Generator,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> tuple[dict[str, torch.Tensor], dict[int, torch.Tensor]]:
    """(the caches vLLM would register, in shuffled order; each layer's physical tensor)."""
    physical, caches = {}, {}
    order = list(layer_ids)
    random.Random(int(torch.randint(1 << 30, (1,), generator=gen))).shuffle(order)
    for i in order:
        if kind == "LBHNC":
            p = torch.empty(
                num_blocks, heads, block_size, 2 * head_size, dtype=dtype, device=device
            )
            view = p
        elif kind == "LBNHC":
            p = torch.empty(
                num_blocks, block_size, heads, 2 * head_size, dtype=dtype, device=device
            )
            view = p.permute(0, 2, 1, 3)
        else:
            p = torch.empty(2, num_blocks, block_size, heads, head_size, dtype=dtype, device=device)
            view = p
        physical[i] = fill_bits_(p, gen)
        caches[layer_name(i)] = view
    return caches, physical


def block_bytes(kind: str, phys: torch.Tensor, block: int) -> list[torch.Tensor]:
    """Per part, the bytes of ``block`` in one layer's physical tensor."""
    planes = [phys[0], phys[1]] if kind == "KV2" else [phys]
    return [p[block].reshape(-1).view(torch.uint8).clone() for p in planes]


def page_bytes(kind: str, physical: dict[int, torch.Tensor], block: int) -> torch.Tensor:
    """A stored page of ``block``: every layer in layer order, each layer's parts in order."""
    return torch.cat([b for i in sorted(physical) for b in block_bytes(kind, physical[i], block)])


def rows_bytes(layout: BlockLayout, block: int) -> torch.Tensor:
    """A page of ``block`` as the layout's rows give it."""
    return torch.cat(
        [
            layout.rows[p][li][block].reshape(-1).view(torch.uint8)
            for li in range(len(layout.layer_ids))
            for p in range(layout.num_parts)
        ]
    )


def refill_(physical: dict[int, torch.Tensor], gen: torch.Generator) -> None:
    for p in physical.values():
        fill_bits_(p, gen)


def set_page_(kind: str, physical: dict[int, torch.Tensor], block: int, page: torch.Tensor):
    """Write a page's bytes into ``block`` of every layer (the inverse of ``page_bytes``)."""
    at = 0
    for i in sorted(physical):
        planes = [physical[i][0], physical[i][1]] if kind == "KV2" else [physical[i]]
        for p in planes:
            dst = p[block].view(-1).view(torch.uint8)
            dst.copy_(page[at : at + dst.numel()])
            at += dst.numel()
    assert at == page.numel()
