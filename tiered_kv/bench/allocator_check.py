"""The untimed check of the allocator benchmark: one fixed draw through every backend.

The slots are distinct, outside page 0 and inside the pool; each new token sits at its
position's offset in a page and continues its predecessor's page; and every backend (plus the
paged torch path at page size 1) returns identical tensors and leaves an identical free list
(the same set of pages where the allocator classes order it differently).
A mismatch is a ``verify.fail``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tiered_kv.bench.allocator import (
    Batch,
    Lengths,
    Sample,
    allocator_label,
    config_generator,
    draw_batch,
    make_allocator,
    pool_size,
    run_once,
)
from tiered_kv.bench.verify import CHECK_FAILED, fail
from tiered_kv.device.allocator.base import BaseTokenToKVPoolAllocator
from tiered_kv.device.allocator.paged import PagedTokenToKVPoolAllocator
from tiered_kv.errors import TieredKVError


def check_distinct(where: str, name: str, slots: torch.Tensor, num_pages: int, page: int) -> None:
    slots = slots.cpu()
    if slots.numel() == 0:
        return
    if torch.unique(slots).numel() != slots.numel():
        uniq, counts = torch.unique(slots, return_counts=True)
        fail(where, f"{name}: slots handed out twice: {uniq[counts > 1][:8].tolist()}")
    if int(slots.min()) < page:
        fail(where, f"{name}: slot {int(slots.min())} is in the padding page 0")
    if int(slots.max()) >= (num_pages + 1) * page:
        fail(where, f"{name}: slot {int(slots.max())} is outside the pool")


def layout_error(
    name: str,
    slots: torch.Tensor,
    before: torch.Tensor,
    new: torch.Tensor,
    last_loc: torch.Tensor,
    page: int,
) -> str | None:
    """Why ``slots`` (the new tokens of every request, request after request) break the paged
    layout, or None: token ``pos`` must sit at offset ``pos % page`` and, unless it opens a page,
    right after the slot of token ``pos - 1`` (``last_loc`` for a request's first new token)."""
    if slots.numel() == 0:
        return None
    out_start = torch.cumsum(new, 0) - new
    req = torch.repeat_interleave(torch.arange(new.numel()), new)
    pos = before[req] + torch.arange(slots.numel()) - out_start[req]
    prev = torch.cat((slots[:1], slots[:-1]))
    prev[out_start[new > 0]] = last_loc[new > 0]
    continues = pos % page != 0
    bad = (slots % page != pos % page) | (continues & (slots != prev + 1))
    if not bool(bad.any()):
        return None
    i = int(torch.nonzero(bad)[0, 0])
    expected = (
        f"{int(prev[i]) + 1} (right after token {int(pos[i]) - 1}'s slot {int(prev[i])})"
        if bool(continues[i])
        else f"the first slot of a fresh page (a multiple of {page})"
    )
    return (
        f"{name}: request {int(req[i])} token {int(pos[i])} got slot {int(slots[i])}, "
        f"expected {expected}; {int(bad.sum())} of {slots.numel()} tokens are misplaced"
    )


def check_layout(where: str, batch: Batch, s: Sample, page: int) -> None:
    """Prefix, extend and decode slots all follow the paged layout."""
    prefix_slots = s.prefix_slots.cpu()
    last_loc = torch.full_like(batch.prefix, -1)
    has = batch.prefix > 0
    last_loc[has] = prefix_slots[(torch.cumsum(batch.prefix, 0) - 1)[has]]
    zeros, ones = torch.zeros_like(batch.prefix), torch.ones_like(batch.prefix)
    checks = (
        ("prefix alloc_extend", prefix_slots, zeros, batch.prefix, last_loc),
        ("alloc_extend", s.extend_slots.cpu(), batch.prefix, batch.extend, last_loc),
        ("alloc_decode", s.decode_slots.cpu(), batch.prefix, ones, last_loc),
    )
    for name, slots, before, new, loc in checks:
        error = layout_error(name, slots, before, new, loc, page)
        if error:
            fail(where, error)


def check_sample(where: str, batch: Batch, s: Sample, alloc: BaseTokenToKVPoolAllocator) -> None:
    pages, page = alloc.num_pages, alloc.page_size
    check_layout(where, batch, s, page)
    check_distinct(where, "prefix+extend", torch.cat((s.prefix_slots, s.extend_slots)), pages, page)
    check_distinct(where, "prefix+decode", torch.cat((s.prefix_slots, s.decode_slots)), pages, page)


def compare_samples(
    where: str, ref_label: str, ref: Sample, label: str, s: Sample, *, same_order: bool = True
) -> None:
    """Identical tensors; without ``same_order`` (allocators whose free lists differ in order:
    the token allocator appends freed slots, the paged one pushes them in front) the free
    lists hold the same pages."""
    for field in ("prefix_slots", "extend_slots", "decode_slots", "free_after_free"):
        a, b = getattr(ref, field).cpu(), getattr(s, field).cpu()
        if field == "free_after_free" and not same_order:
            a, b = torch.sort(a)[0], torch.sort(b)[0]
        if torch.equal(a, b):
            continue
        if a.shape != b.shape:
            fail(where, f"{field}: {ref_label} has {a.numel()} entries, {label} {b.numel()}")
        i = int(torch.nonzero(a != b)[0, 0])
        fail(
            where,
            f"{field} differs between {ref_label} and {label} at index {i} "
            f"({int(a[i])} vs {int(b[i])}; {int((a != b).sum())} of {a.numel()} differ)",
        )


def verification_variants(backends: Sequence[str], page_size: int) -> list[tuple[str, str, bool]]:
    """(label, backend, force paged) for every allocator the check runs on one draw."""
    variants = [(f"{b}/{allocator_label(b, page_size)}", b, False) for b in backends]
    if page_size == 1 and "torch" in backends:
        variants.append((f"torch/{PagedTokenToKVPoolAllocator.__name__}", "torch", True))
    return variants


def verify_config(
    backends: Sequence[str],
    page_size: int,
    bs: int,
    lengths: Lengths,
    seed: int,
    device: torch.device,
) -> None:
    """One draw through every backend from the same empty pool; ``fail`` on any mismatch."""
    where = f"page_size={page_size} batch={bs} seed={seed}"
    batch = draw_batch(config_generator(seed, page_size, bs, salt=1), bs, page_size, lengths)
    size = pool_size(bs, page_size, lengths)
    reference: tuple[str, Sample, type] | None = None
    for label, backend, paged in verification_variants(backends, page_size):
        alloc = make_allocator(backend, page_size, size, device, paged=paged)
        try:
            sample = run_once(alloc, batch, device)
        except TieredKVError as exc:
            if str(exc).startswith(CHECK_FAILED):
                raise
            fail(f"{where} {label}", f"the allocator raised {type(exc).__name__}: {exc}")
        check_sample(f"{where} {label}", batch, sample, alloc)
        if reference is None:
            reference = (label, sample, type(alloc))
        else:
            same = type(alloc) is reference[2]
            compare_samples(where, reference[0], reference[1], label, sample, same_order=same)
