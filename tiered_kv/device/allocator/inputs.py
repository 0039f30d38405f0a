"""Checks of allocation arguments, shared by the allocators. They raise InvalidArgumentError
naming the value and what would be valid, before anything changes.

Shape, dtype and device checks are always on. Checks that read index values on the device
(device copies equal the CPU copies, ``last_loc`` sits where the prefix ends) run when
``allocator.validate_values`` is set: always on CPU, in debug mode on CUDA (they sync)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tiered_kv._checks import check_index_tensor
from tiered_kv.errors import InvalidArgumentError

if TYPE_CHECKING:
    from tiered_kv.device.allocator.base import BaseTokenToKVPoolAllocator

_CPU = torch.device("cpu")


def _same_length(bs: int, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.shape[0] != bs:
            raise InvalidArgumentError(
                f"{name} has {t.shape[0]} entries; expected {bs} (one per request)"
            )


def _check_last_loc(
    alloc: BaseTokenToKVPoolAllocator, last_loc: torch.Tensor, used_len: torch.Tensor, where: str
) -> None:
    """``last_loc[i]`` must be the slot of token ``used_len[i] - 1`` wherever the next token
    continues a half-full page (``used_len % page_size != 0``)."""
    page = alloc.page_size
    continues = (used_len > 0) & (used_len % page != 0)
    if not bool(continues.any()):
        return
    loc = last_loc.to(_CPU, torch.int64)[continues]
    expect_offset = (used_len[continues] - 1) % page
    in_pool = (loc >= page) & (loc < (alloc.num_pages + 1) * page)
    wrong = ~in_pool | (loc % page != expect_offset)
    if bool(wrong.any()):
        i = int(torch.nonzero(continues)[torch.nonzero(wrong)[0, 0], 0])
        raise InvalidArgumentError(
            f"{where}: last_loc[{i}]={int(last_loc[i])} cannot end a prefix of "
            f"{int(used_len[i])} tokens; it must be a slot in pages 1..{alloc.num_pages} with "
            f"offset {(int(used_len[i]) - 1) % page} in its page"
        )


def check_extend_args(
    alloc: BaseTokenToKVPoolAllocator,
    prefix_lens: torch.Tensor,
    prefix_lens_cpu: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    last_loc: torch.Tensor,
    extend_num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``alloc_extend`` arguments; return the CPU lengths as int64."""
    dev = alloc.device
    check_index_tensor("prefix_lens", prefix_lens, dev)
    check_index_tensor("seq_lens", seq_lens, dev)
    check_index_tensor("last_loc", last_loc, dev)
    check_index_tensor("prefix_lens_cpu", prefix_lens_cpu, _CPU)
    check_index_tensor("seq_lens_cpu", seq_lens_cpu, _CPU)
    bs = prefix_lens.shape[0]
    _same_length(
        bs,
        seq_lens=seq_lens,
        last_loc=last_loc,
        prefix_lens_cpu=prefix_lens_cpu,
        seq_lens_cpu=seq_lens_cpu,
    )
    if isinstance(extend_num_tokens, bool) or not isinstance(extend_num_tokens, int):
        raise InvalidArgumentError(f"extend_num_tokens={extend_num_tokens!r} must be an int")
    pre = prefix_lens_cpu.to(torch.int64)
    seq = seq_lens_cpu.to(torch.int64)
    if bs and bool((pre < 0).any()):
        i = int(torch.nonzero(pre < 0)[0, 0])
        raise InvalidArgumentError(f"prefix_lens[{i}]={int(pre[i])} is negative; lengths are >= 0")
    if bs and bool((seq < pre).any()):
        i = int(torch.nonzero(seq < pre)[0, 0])
        raise InvalidArgumentError(
            f"prefix_lens[{i}]={int(pre[i])} is longer than seq_lens[{i}]={int(seq[i])}; "
            "a prefix cannot exceed its sequence"
        )
    total = int((seq - pre).sum()) if bs else 0
    if extend_num_tokens != total:
        raise InvalidArgumentError(
            f"extend_num_tokens={extend_num_tokens} but seq_lens - prefix_lens sums to {total}"
        )
    if alloc.validate_values and bs:
        if not torch.equal(prefix_lens.to(_CPU, torch.int64), pre):
            raise InvalidArgumentError("prefix_lens and prefix_lens_cpu hold different values")
        if not torch.equal(seq_lens.to(_CPU, torch.int64), seq):
            raise InvalidArgumentError("seq_lens and seq_lens_cpu hold different values")
        _check_last_loc(alloc, last_loc, pre, "alloc_extend")
    return pre, seq


def check_decode_args(
    alloc: BaseTokenToKVPoolAllocator,
    seq_lens: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    last_loc: torch.Tensor,
) -> torch.Tensor:
    """Validate ``alloc_decode`` arguments; return the CPU lengths as int64."""
    dev = alloc.device
    check_index_tensor("seq_lens", seq_lens, dev)
    check_index_tensor("last_loc", last_loc, dev)
    check_index_tensor("seq_lens_cpu", seq_lens_cpu, _CPU)
    bs = seq_lens.shape[0]
    _same_length(bs, last_loc=last_loc, seq_lens_cpu=seq_lens_cpu)
    seq = seq_lens_cpu.to(torch.int64)
    if bs and bool((seq < 1).any()):
        i = int(torch.nonzero(seq < 1)[0, 0])
        raise InvalidArgumentError(
            f"seq_lens[{i}]={int(seq[i])}; a decode length counts the new token, so it is >= 1"
        )
    if alloc.validate_values and bs:
        if not torch.equal(seq_lens.to(_CPU, torch.int64), seq):
            raise InvalidArgumentError("seq_lens and seq_lens_cpu hold different values")
        _check_last_loc(alloc, last_loc, seq - 1, "alloc_decode")
    return seq


def check_need_size(need_size: object, page_size: int) -> int:
    if isinstance(need_size, bool) or not isinstance(need_size, int) or need_size < 0:
        raise InvalidArgumentError(f"need_size={need_size!r} must be an int >= 0")
    if need_size % page_size:
        raise InvalidArgumentError(
            f"need_size={need_size} is not a multiple of page_size={page_size}; alloc() hands out "
            "whole pages (use alloc_extend for token-granular growth)"
        )
    return need_size
