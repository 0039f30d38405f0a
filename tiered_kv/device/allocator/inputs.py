"""Checks of allocation and free arguments, shared by the allocators. They raise
InvalidArgumentError naming the value and what would be valid, before anything changes.

Split by cost. Always on: every tensor is a 1-D integer tensor on the right device, the lengths
agree, the counts are ints (three attribute reads a tensor, about 0.45 us on a CPU; the slow,
message-building check runs only when the fast one fails), and every id a free is given lies in
the pool (``check_free_slots`` / ``check_free_pages``: one ``aminmax`` and two scalar reads, about
2 us on a CPU and a device sync on CUDA). A freed id outside the pool would not fail by itself:
it would enter the free list, be handed out, and turn the next legitimate free into a double
free. Debug mode only (``allocator.debug_mode``): the other checks that read values, a device
sync each on CUDA: lengths non-negative and consistent, device copies equal to the CPU copies,
``extend_num_tokens`` their sum, ``last_loc`` where the prefix ends.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tiered_kv._checks import INDEX_DTYPES, check_index_tensor
from tiered_kv.errors import InvalidArgumentError


class AllocatorView(Protocol):
    """What the checks read of an allocator (``BaseTokenToKVPoolAllocator`` has it all)."""

    page_size: int
    num_pages: int
    device: torch.device
    device_index: int | None  # None: the CPU
    debug_mode: bool

    def get_all_free_pages(self) -> torch.Tensor: ...


def check_kv_pool(name: str, pool: object) -> None:
    """``pool`` is a device KV pool (None allowed): it has the ``size`` / ``page_size`` the
    allocator compares and the ``host_pool_decls`` the host tier reads. A duck check, since the
    composite pools (sliding-window, hybrid-linear) are not ``KVCache`` subclasses."""
    if pool is None:
        return
    if not all(hasattr(pool, a) for a in ("size", "page_size", "host_pool_decls")):
        raise InvalidArgumentError(
            f"{name}={pool!r:.60} ({type(pool).__name__}) is not a device KV pool; pass the pool "
            "the allocator hands out slots of (e.g. an MHATokenToKVPool), or None"
        )


_CPU = torch.device("cpu")
_IDX = tuple(sorted(INDEX_DTYPES, key=lambda d: d != torch.int64))  # int64 first: the common one
_Tensor = torch.Tensor


def index_ok(t: object, device_index: int | None) -> bool:
    """The fast check: ``t`` is a 1-D integer tensor on the device (``None``: the CPU; else
    the CUDA device of that index). False means: run ``check_index_tensor`` to decide."""
    try:
        return (
            t.dim() == 1  # type: ignore[union-attr]
            and t.dtype in _IDX  # type: ignore[union-attr]
            and (t.is_cpu if device_index is None else t.get_device() == device_index)  # type: ignore[union-attr]
            and isinstance(t, _Tensor)
        )
    except AttributeError:
        return False


def check_index(name: str, t: torch.Tensor, alloc: AllocatorView) -> None:
    if not index_ok(t, alloc.device_index):
        check_index_tensor(name, t, alloc.device)


def outside(ids: torch.Tensor, low: int, high: int) -> list[int] | None:
    """None if every id of the 1-D ``ids`` lies in ``[low, high)`` (or there is none), else up
    to 8 of those that do not. The pass is one ``aminmax`` and two scalar reads (a device sync
    on CUDA), never a Python loop; only a failure looks at the values again, to name them."""
    if ids.shape[0] == 0:
        return None
    lo, hi = torch.aminmax(ids)
    if lo.item() >= low and hi.item() < high:
        return None
    return ids[(ids < low) | (ids >= high)][:8].tolist()


def check_free_slots(alloc: AllocatorView, name: str, slots: torch.Tensor) -> None:
    """Every slot of ``slots`` lies in pages 1..num_pages: page 0 is the padding
    sink, never handed out, so never freed. In every mode."""
    p = alloc.page_size
    bad = outside(slots, p, (alloc.num_pages + 1) * p)
    if bad is not None:
        last = (alloc.num_pages + 1) * p - 1
        pad = "slot 0 is" if p == 1 else f"page 0, slots 0..{p - 1}, is"
        raise InvalidArgumentError(
            f"{name} has values {bad} outside the valid range [{p}, {last + 1}): valid slots are "
            f"{p}..{last} ({pad} the padding sink); nothing was changed"
        )


def check_free_pages(alloc: AllocatorView, name: str, pages: torch.Tensor) -> None:
    """Every page id of ``pages`` lies in 1..num_pages (page 0 is padding)."""
    bad = outside(pages, 1, alloc.num_pages + 1)
    if bad is not None:
        raise InvalidArgumentError(
            f"{name} has values {bad} outside the valid range [1, {alloc.num_pages + 1}): valid "
            f"pages are 1..{alloc.num_pages} (page 0 is the padding sink); nothing was changed"
        )


def _same_length(bs: int, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.shape[0] != bs:
            raise InvalidArgumentError(
                f"{name} has {t.shape[0]} entries; expected {bs} (one per request)"
            )


def check_extend_args(
    alloc: AllocatorView,
    prefix_lens: torch.Tensor,
    prefix_lens_cpu: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    last_loc: torch.Tensor,
    extend_num_tokens: int,
) -> None:
    """Validate ``alloc_extend`` arguments (values only in debug mode)."""
    dev = alloc.device_index
    try:
        # One shape read per tensor covers 1-D and the common length.
        shape = prefix_lens.shape
        ok = (
            len(shape) == 1
            and seq_lens.shape == shape
            and last_loc.shape == shape
            and prefix_lens_cpu.shape == shape
            and seq_lens_cpu.shape == shape
            and prefix_lens.dtype in _IDX
            and seq_lens.dtype in _IDX
            and last_loc.dtype in _IDX
            and prefix_lens_cpu.dtype in _IDX
            and seq_lens_cpu.dtype in _IDX
            and prefix_lens_cpu.is_cpu
            and seq_lens_cpu.is_cpu
            and (
                (prefix_lens.is_cpu and seq_lens.is_cpu and last_loc.is_cpu)
                if dev is None
                else (
                    prefix_lens.get_device() == dev
                    and seq_lens.get_device() == dev
                    and last_loc.get_device() == dev
                )
            )
        )
    except AttributeError:
        ok = False
    if not ok:
        for name, t, where in (
            ("prefix_lens", prefix_lens, alloc.device),
            ("seq_lens", seq_lens, alloc.device),
            ("last_loc", last_loc, alloc.device),
            ("prefix_lens_cpu", prefix_lens_cpu, _CPU),
            ("seq_lens_cpu", seq_lens_cpu, _CPU),
        ):
            check_index_tensor(name, t, where)
        _same_length(
            prefix_lens.shape[0],
            seq_lens=seq_lens,
            last_loc=last_loc,
            prefix_lens_cpu=prefix_lens_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
    if type(extend_num_tokens) is not int or extend_num_tokens < 0:
        raise InvalidArgumentError(f"extend_num_tokens={extend_num_tokens!r} must be an int >= 0")
    if alloc.debug_mode and prefix_lens.shape[0]:
        _check_extend_values(
            alloc, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens
        )


def check_decode_args(
    alloc: AllocatorView,
    seq_lens: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    last_loc: torch.Tensor,
) -> None:
    """Validate ``alloc_decode`` arguments (values only in debug mode)."""
    dev = alloc.device_index
    try:
        shape = seq_lens.shape
        ok = (
            len(shape) == 1
            and last_loc.shape == shape
            and seq_lens_cpu.shape == shape
            and seq_lens.dtype in _IDX
            and last_loc.dtype in _IDX
            and seq_lens_cpu.dtype in _IDX
            and seq_lens_cpu.is_cpu
            and (
                (seq_lens.is_cpu and last_loc.is_cpu)
                if dev is None
                else (seq_lens.get_device() == dev and last_loc.get_device() == dev)
            )
        )
    except AttributeError:
        ok = False
    if not ok:
        check_index_tensor("seq_lens", seq_lens, alloc.device)
        check_index_tensor("last_loc", last_loc, alloc.device)
        check_index_tensor("seq_lens_cpu", seq_lens_cpu, _CPU)
        _same_length(seq_lens.shape[0], last_loc=last_loc, seq_lens_cpu=seq_lens_cpu)
    if alloc.debug_mode and seq_lens.shape[0]:
        seq = seq_lens_cpu.to(torch.int64)
        if bool((seq < 1).any()):
            i = int(torch.nonzero(seq < 1)[0, 0])
            raise InvalidArgumentError(
                f"seq_lens[{i}]={int(seq[i])}; a decode length counts the new token, so it is >= 1"
            )
        if not torch.equal(seq_lens.to(_CPU, torch.int64), seq):
            raise InvalidArgumentError("seq_lens and seq_lens_cpu hold different values")
        _check_last_loc(alloc, last_loc, seq - 1, "alloc_decode")


def check_need_size(need_size: object, page_size: int) -> int:
    if type(need_size) is not int or need_size < 0:
        raise InvalidArgumentError(f"need_size={need_size!r} must be an int >= 0")
    if need_size % page_size:
        raise InvalidArgumentError(
            f"need_size={need_size} is not a multiple of page_size={page_size}; alloc() hands out "
            "whole pages (use alloc_extend for token-granular growth)"
        )
    return need_size


# -- debug mode: checks that read values ---------------------------------------------------------
def _check_extend_values(
    alloc: AllocatorView,
    prefix_lens: torch.Tensor,
    prefix_lens_cpu: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    last_loc: torch.Tensor,
    extend_num_tokens: int,
) -> None:
    pre = prefix_lens_cpu.to(torch.int64)
    seq = seq_lens_cpu.to(torch.int64)
    if bool((pre < 0).any()):
        i = int(torch.nonzero(pre < 0)[0, 0])
        raise InvalidArgumentError(f"prefix_lens[{i}]={int(pre[i])} is negative; lengths are >= 0")
    if bool((seq < pre).any()):
        i = int(torch.nonzero(seq < pre)[0, 0])
        raise InvalidArgumentError(
            f"prefix_lens[{i}]={int(pre[i])} is longer than seq_lens[{i}]={int(seq[i])}; "
            "a prefix cannot exceed its sequence"
        )
    total = int((seq - pre).sum())
    if extend_num_tokens != total:
        raise InvalidArgumentError(
            f"extend_num_tokens={extend_num_tokens} but seq_lens - prefix_lens sums to {total}"
        )
    if not torch.equal(prefix_lens.to(_CPU, torch.int64), pre):
        raise InvalidArgumentError("prefix_lens and prefix_lens_cpu hold different values")
    if not torch.equal(seq_lens.to(_CPU, torch.int64), seq):
        raise InvalidArgumentError("seq_lens and seq_lens_cpu hold different values")
    _check_last_loc(alloc, last_loc, pre, "alloc_extend")


def _check_last_loc(
    alloc: AllocatorView, last_loc: torch.Tensor, used_len: torch.Tensor, where: str
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
