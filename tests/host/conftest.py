"""Host-tier tests run torch with one intra-op thread.

The tensors here are small, and on a 2-core machine that is also running something else, torch's
OpenMP workers spin against it and make these tests ~10x slower. The tests that exercise the
native copier's multi-threaded path set their own thread count (``torch_threads``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with torch_threads(1):
        yield
