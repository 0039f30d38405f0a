"""Transfer-worker tests run torch with one intra-op thread: the tensors are tiny, and on a
2-core machine torch's OpenMP workers only fight the copy and storage threads."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.transfer import _util
from tests.transfer._util import torch_threads


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


# The device <-> host worker has two copiers on CPU: Python copy threads calling the host pool's
# copy methods (kernel backend torch), and the native copy engine (kernel backend native). Every
# test of these modules runs on both.
_BOTH_COPIERS = {"test_device_host", "test_contract", "test_faults"}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.module.__name__.rsplit(".", 1)[-1] in _BOTH_COPIERS:
        metafunc.parametrize("copier", ["thread", "engine"], indirect=True)


@pytest.fixture(autouse=True)
def copier(request: pytest.FixtureRequest) -> Iterator[str]:
    """Which copier ``_util.make_host`` pools get: "thread" unless parametrized."""
    which = getattr(request, "param", "thread")
    previous = _util.COPIER["kernel_backend"]
    _util.COPIER["kernel_backend"] = "native" if which == "engine" else "torch"
    try:
        yield which
    finally:
        _util.COPIER["kernel_backend"] = previous
