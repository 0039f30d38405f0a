"""The facade tests' ``make_cache`` fixture, for every module of the cache tests, and one torch
thread for each of them (``_tree_util.one_torch_thread``: load-proof timing)."""

import pytest

from tests.cache._tree_util import one_torch_thread
from tests.cache.test_facade import make_cache  # noqa: F401 - a fixture


@pytest.fixture(autouse=True)
def _one_torch_thread():
    with one_torch_thread():
        yield
