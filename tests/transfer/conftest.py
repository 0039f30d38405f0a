"""Transfer-worker tests run torch with one intra-op thread: the tensors are tiny, and on a
2-core machine torch's OpenMP workers only fight the copy and storage threads."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.transfer._util import torch_threads


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with torch_threads(1):
        yield
