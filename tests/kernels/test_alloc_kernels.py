"""The Triton allocation kernels equal their torch references and a naive per-request oracle."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import naive_decode, naive_extend
from tiered_kv.kernels import alloc_kernels
from tiered_kv.platform import KernelBackend

CPU = torch.device("cpu")
POISON = -1_000_003  # fills memory past free_pages: a read past the free list shows up in out


def _random_extend_batch(gen, bs, page_size, max_prefix=300, max_extend=200):
    prefix = torch.randint(0, max_prefix, (bs,), generator=gen)
    # A third of the prefixes on a page boundary (including 0), a few requests with no new token.
    prefix[::3] = prefix[::3] // page_size * page_size
    extend = torch.randint(0, max_extend, (bs,), generator=gen)
    extend[1::7] = 0
    seq = prefix + extend
    # last_loc: the slot of token prefix-1, on some random page, at offset (prefix-1) % P.
    pages = torch.randint(1, 10_000, (bs,), generator=gen)
    last_loc = torch.where(prefix > 0, pages * page_size + (prefix - 1) % page_size, -1)
    return prefix, seq, last_loc


def _free_pages_with_poison(gen, need, slack=8):
    """Exactly ``need`` distinct random page ids as a view whose storage continues with poison."""
    backing = torch.full((need + slack,), POISON, dtype=torch.int64)
    backing[:need] = torch.randperm(50_000, generator=gen)[:need] + 1
    return backing[:need]


def _run(backend, fn_name, *args):
    kernels = alloc_kernels(CPU, backend)
    assert kernels.backend is KernelBackend(backend)
    getattr(kernels, fn_name)(*args)


BATCHES = [1, 2, 3, 17, 64, 130, 300]


@pytest.mark.parametrize("page_size", [1, 16, 64, 48])
@pytest.mark.parametrize("bs", BATCHES)
def test_alloc_extend_matches_reference_and_oracle(gen, page_size, bs):
    if bs == 300 and page_size == 48:
        pytest.skip("covered by the power-of-two page sizes at bs=300")
    prefix, seq, last_loc = _random_extend_batch(gen, bs, page_size)
    new_pages = int(
        ((seq + page_size - 1) // page_size - (prefix + page_size - 1) // page_size).sum()
    )
    free_pages = _free_pages_with_poison(gen, new_pages)
    total = int((seq - prefix).sum())
    expect, used = naive_extend(
        prefix.tolist(), seq.tolist(), last_loc.tolist(), free_pages.tolist(), page_size
    )
    assert used == new_pages
    outs = {}
    for backend in ("torch", "triton"):
        out = torch.full((total,), -7, dtype=torch.int64)
        _run(backend, "alloc_extend", prefix, seq, last_loc, free_pages, out, page_size)
        outs[backend] = out
    assert outs["torch"].tolist() == expect
    assert torch.equal(outs["triton"], outs["torch"])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_alloc_extend_int32_lengths(gen, dtype):
    prefix, seq, last_loc = _random_extend_batch(gen, 9, 16)
    need = int(((seq + 15) // 16 - (prefix + 15) // 16).sum())
    free_pages = _free_pages_with_poison(gen, need)
    total = int((seq - prefix).sum())
    outs = []
    for backend in ("torch", "triton"):
        out = torch.empty((total,), dtype=torch.int64)
        _run(
            backend, "alloc_extend", prefix.to(dtype), seq.to(dtype), last_loc, free_pages, out, 16
        )
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_alloc_extend_long_extend_crosses_several_blocks(gen):
    """One request longer than the kernel's block: the dynamic loop runs several iterations."""
    page_size = 16
    prefix = torch.tensor([5, 0, 37])
    seq = torch.tensor([5 + 2500, 1, 37 + 1100])
    last_loc = torch.tensor([3 * 16 + 4, -1, 9 * 16 + 4])
    need = int(((seq + 15) // 16 - (prefix + 15) // 16).sum())
    free_pages = _free_pages_with_poison(gen, need)
    expect, _ = naive_extend(
        prefix.tolist(), seq.tolist(), last_loc.tolist(), free_pages.tolist(), 16
    )
    out = torch.empty((int((seq - prefix).sum()),), dtype=torch.int64)
    _run("triton", "alloc_extend", prefix, seq, last_loc, free_pages, out, page_size)
    assert out.tolist() == expect


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("bs", BATCHES)
def test_alloc_decode_matches_reference_and_oracle(gen, page_size, bs):
    seq = torch.randint(1, 500, (bs,), generator=gen)
    seq[::4] = (seq[::4] // page_size) * page_size + 1  # these open a new page
    pages = torch.randint(1, 10_000, (bs,), generator=gen)
    last_loc = torch.where(seq > 1, pages * page_size + (seq - 2) % page_size, -1)
    need = int(((seq - 1) % page_size == 0).sum())
    free_pages = _free_pages_with_poison(gen, need)
    expect, used = naive_decode(seq.tolist(), last_loc.tolist(), free_pages.tolist(), page_size)
    assert used == need
    outs = {}
    for backend in ("torch", "triton"):
        out = torch.full((bs,), -7, dtype=torch.int64)
        _run(backend, "alloc_decode", seq, last_loc, free_pages, out, page_size)
        outs[backend] = out
    assert outs["torch"].tolist() == expect
    assert torch.equal(outs["triton"], outs["torch"])


def test_empty_batches_are_noops():
    empty = torch.empty((0,), dtype=torch.int64)
    for backend in ("torch", "triton"):
        out = torch.empty((0,), dtype=torch.int64)
        _run(backend, "alloc_extend", empty, empty, empty, empty, out, 16)
        _run(backend, "alloc_decode", empty, empty, empty, out, 16)
        assert out.numel() == 0


def test_triton_launcher_rejects_mismatched_shapes():
    kernels = alloc_kernels(CPU, "triton")
    out = torch.empty((4,), dtype=torch.int64)
    with pytest.raises(ValueError, match="seq_lens"):
        kernels.alloc_extend(
            torch.zeros(2, dtype=torch.int64),
            torch.ones(3, dtype=torch.int64),
            torch.full((2,), -1),
            torch.arange(1, 5),
            out,
            16,
        )


@pytest.mark.parametrize("page_size", [1, 16, 48])
@pytest.mark.parametrize("bs", [1, 2, 40])
def test_reference_with_host_hints_matches_oracle(gen, page_size, bs):
    """The allocator passes what it knows on the host (the CPU lengths, the page count); the
    reference's short paths (one request, page size 1) and its general path agree with the
    oracle with and without them, and read no page past the count."""
    prefix, seq, last_loc = _random_extend_batch(gen, bs, page_size)
    need = int(((seq + page_size - 1) // page_size - (prefix + page_size - 1) // page_size).sum())
    free_pages = _free_pages_with_poison(gen, need)
    expect, _ = naive_extend(
        prefix.tolist(), seq.tolist(), last_loc.tolist(), free_pages.tolist(), page_size
    )
    hints = dict(num_new_pages=need, prefix_lens_cpu=prefix.clone(), seq_lens_cpu=seq.clone())
    for backend in ("torch", "triton"):
        out = torch.full((int((seq - prefix).sum()),), -7, dtype=torch.int64)
        kernels = alloc_kernels(CPU, backend)
        kernels.alloc_extend(prefix, seq, last_loc, free_pages, out, page_size, **hints)
        assert out.tolist() == expect


@pytest.mark.parametrize("opening", ["none", "all", "some"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_decode_with_no_all_or_some_new_pages(gen, opening, page_size):
    bs = 37
    seq = torch.randint(2, 500, (bs,), generator=gen)
    seq = torch.where(seq % page_size == 1, seq + 1, seq)  # nobody opens a page
    if opening == "all":
        seq = (seq // page_size) * page_size + 1
    elif opening == "some":
        seq[::3] = (seq[::3] // page_size) * page_size + 1
    pages = torch.randint(1, 10_000, (bs,), generator=gen)
    last_loc = torch.where(seq > 1, pages * page_size + (seq - 2) % page_size, -1)
    need = int((seq % page_size == 1).sum())
    free_pages = _free_pages_with_poison(gen, need)
    expect, used = naive_decode(seq.tolist(), last_loc.tolist(), free_pages.tolist(), page_size)
    assert (
        used == need and (need == 0) == (opening == "none") and (need == bs) == (opening == "all")
    )
    for hint in ({}, {"num_new_pages": need, "seq_lens_cpu": seq.clone()}):
        out = torch.full((bs,), -7, dtype=torch.int64)
        alloc_kernels(CPU, "torch").alloc_decode(seq, last_loc, free_pages, out, page_size, **hint)
        assert out.tolist() == expect
