"""HostPages: vLLM's blocks copied to host slots and back bit for bit (NaN payloads included) in
each block layout, on both CPU copy paths (the native copier and the torch reference); a layer
at a time equals all layers at once; bad plans are refused; the store's PageSource view."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.integrations.vllm.block_layout import describe_layers
from tiered_kv.integrations.vllm.host_pages import HostPages
from tiered_kv.platform import use_kernel_backend

from ._kv import KINDS, block_bytes, fill_bits_, make_caches, page_bytes, refill_

NB, H, N, D = 11, 3, 5, 12
LAYERS = [3, 0, 7]
BACKENDS = [None, "torch"]  # None: auto (the native copier where a C compiler is present)


def _pages(kind, gen, backend, num_slots=6, dtype=torch.float32):
    caches, physical = make_caches(kind, LAYERS, NB, H, N, D, gen, dtype)
    layout = describe_layers(caches, NB)
    with use_kernel_backend(backend):
        pages = HostPages(layout, num_slots)
    if backend == "torch":  # the override reached the launcher
        assert pages._launch.__module__.endswith("transfer_reference")
    fill_bits_(pages.buffer, gen)
    return layout, physical, pages


def _perm(gen, n, k):
    return torch.randperm(n, generator=gen)[:k].tolist()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_blocks_to_host_and_back_are_bit_exact(gen, kind, backend):
    layout, physical, pages = _pages(kind, gen, backend)
    try:
        blocks = _perm(gen, NB, 5)  # unsorted, with gaps
        slots = _perm(gen, pages.num_pages, 5)
        untouched = [s for s in range(pages.num_pages) if s not in slots]
        before = {s: pages.get_page_bytes(s).clone() for s in untouched}
        saved = {b: page_bytes(kind, physical, b) for b in blocks}
        pages.copy(pages.plan(blocks, slots), to_host=True)
        for b, s in zip(blocks, slots, strict=True):
            assert torch.equal(pages.get_page_bytes(s), saved[b])
        for s in untouched:
            assert torch.equal(pages.get_page_bytes(s), before[s])

        refill_(physical, gen)  # fresh bytes everywhere, then the pages back to other blocks
        targets = _perm(gen, NB, 5)
        kept = {b: page_bytes(kind, physical, b) for b in range(NB) if b not in targets}
        pages.copy(pages.plan(targets, slots), to_host=False)
        for t, b in zip(targets, blocks, strict=True):
            assert torch.equal(page_bytes(kind, physical, t), saved[b])
        for b, want in kept.items():
            assert torch.equal(page_bytes(kind, physical, b), want)
    finally:
        pages.destroy()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_layer_at_a_time_equals_all_layers(gen, kind, backend):
    layout, physical, pages = _pages(kind, gen, backend, dtype=torch.bfloat16)
    try:
        blocks, slots = _perm(gen, NB, 4), _perm(gen, pages.num_pages, 4)
        plan = pages.plan(blocks, slots)
        pages.copy(plan, to_host=True)
        whole = pages.buffer.clone()
        fill_bits_(pages.buffer, gen)
        order = _perm(gen, len(LAYERS), len(LAYERS))
        for li in order:
            pages.copy(plan, to_host=True, layers=[li])
        for s in slots:
            assert torch.equal(pages.buffer[s].view(torch.int16), whole[s].view(torch.int16))

        refill_(physical, gen)
        device_before = {i: p.clone() for i, p in physical.items()}
        li = order[0]
        pages.copy(plan, to_host=False, layers=[li])
        layer_id = layout.layer_ids[li]
        for i, p in physical.items():
            for b in range(NB):
                got = block_bytes(kind, p, b)
                if i == layer_id and b in blocks:
                    rec = whole[slots[blocks.index(b)], li]
                    want = [rec[q].view(torch.uint8) for q in range(layout.num_parts)]
                else:
                    want = block_bytes(kind, device_before[i], b)
                assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    finally:
        pages.destroy()


def test_an_empty_plan_copies_nothing(gen):
    layout, physical, pages = _pages("LBHNC", gen, None)
    try:
        before = pages.buffer.clone()
        pages.copy(pages.plan([], []), to_host=True)
        assert torch.equal(pages.buffer.view(torch.int32), before.view(torch.int32))
    finally:
        pages.destroy()


@pytest.mark.parametrize(
    ("blocks", "slots", "match"),
    [
        ([0, NB], [0, 1], "blocks"),
        ([-1], [0], "blocks"),
        ([1, 2], [0, 6], "host slots"),
        ([1], [-1], "host slots"),
        ([1, 2], [0], "2 blocks but 1 host slots"),
    ],
)
def test_a_bad_plan_is_refused(gen, blocks, slots, match):
    layout, physical, pages = _pages("LBNHC", gen, None)
    try:
        with pytest.raises(InvalidArgumentError, match=match):
            pages.plan(blocks, slots)
    finally:
        pages.destroy()


@pytest.mark.parametrize("kind", KINDS)
def test_page_source_view_round_trips(gen, kind):
    layout, physical, pages = _pages(kind, gen, None)
    try:
        n = pages.page_nbytes
        assert n == layout.page_nbytes == pages.get_page_bytes(0).numel()
        raw = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
        pages.set_page_bytes(2, raw.numpy().tobytes())  # bytes, as a store hands them
        assert torch.equal(pages.get_page_bytes(2), raw)
        other = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
        pages.set_page_bytes(4, memoryview(other.numpy()))
        assert torch.equal(pages.get_page_bytes(4), other)
        rows = pages.page_bytes_rows()
        assert rows.shape == (pages.num_pages, n)
        assert np.array_equal(rows[2], raw.numpy()) and np.array_equal(rows[4], other.numpy())
        with pytest.raises(InvalidArgumentError, match=f"{n - 1} bytes"):
            pages.set_page_bytes(1, bytes(n - 1))

        # what the store filled is what a load copies onto a block
        pages.copy(pages.plan([NB - 1], [2]), to_host=False)
        assert torch.equal(page_bytes(kind, physical, NB - 1), raw)
    finally:
        pages.destroy()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_blocks_to_host_and_back_are_bit_exact(gen, kind):
    """The Triton copier on CUDA blocks: the bytes are in place when ``copy`` returns."""
    caches, physical = make_caches(kind, LAYERS, NB, H, N, D, gen, torch.bfloat16, "cuda")
    pages = HostPages(describe_layers(caches, NB), 6)
    try:
        blocks, slots = _perm(gen, NB, 5), _perm(gen, pages.num_pages, 5)
        saved = {b: page_bytes(kind, physical, b).cpu() for b in blocks}
        pages.copy(pages.plan(blocks, slots), to_host=True)
        for b, s in zip(blocks, slots, strict=True):
            assert torch.equal(pages.get_page_bytes(s), saved[b])
        refill_(physical, gen)
        targets = _perm(gen, NB, 5)
        pages.copy(pages.plan(targets, slots), to_host=False)
        for t, b in zip(targets, blocks, strict=True):
            assert torch.equal(page_bytes(kind, physical, t).cpu(), saved[b])
    finally:
        pages.destroy()
