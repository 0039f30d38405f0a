"""Shared test helpers: seeded generators and naive per-request allocation oracles."""

from __future__ import annotations

import os
import random
import zlib

import pytest
import torch

# Tests run on CPU; the Triton path runs under the interpreter there.
os.environ.setdefault("TIERED_KV_DEVICE", "cpu")
# Allocators built without debug_mode= check index values (double frees, ranges, last_loc),
# as production does not; tests of the production default pass debug_mode=False.
os.environ.setdefault("TIERED_KV_DEBUG", "1")

# Fresh data every run; rerun a failure with TIERED_KV_TEST_SEED=<the seed in the header>.
BASE_SEED = int(os.environ.get("TIERED_KV_TEST_SEED", random.randrange(2**31)))


def pytest_report_header(config):
    return f"tiered_kv test seed: TIERED_KV_TEST_SEED={BASE_SEED}"


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the run's seed and the test's id."""
    seed = (BASE_SEED ^ zlib.crc32(request.node.nodeid.encode())) % (2**31)
    return torch.Generator().manual_seed(seed)


def naive_extend(prefix, seq, last_loc, free_pages, page_size):
    """Per-request loop oracle for alloc_extend (independent of the vectorised reference)."""
    out, next_page = [], 0
    for pre, s, last in zip(prefix, seq, last_loc, strict=True):
        cur = last
        for pos in range(pre, s):
            if pos % page_size == 0:
                cur = free_pages[next_page] * page_size
                next_page += 1
            else:
                cur = cur + 1
            out.append(cur)
    return out, next_page


def naive_decode(seq, last_loc, free_pages, page_size):
    out, next_page = [], 0
    for s, last in zip(seq, last_loc, strict=True):
        if (s - 1) % page_size == 0:
            out.append(free_pages[next_page] * page_size)
            next_page += 1
        else:
            out.append(last + 1)
    return out, next_page
