"""One torch thread for every engine test (``tests.cache._tree_util.one_torch_thread``): the
serving engine's random workloads run small ops by the thousand, which a two-thread pool slows
many times over next to any other busy process."""

import pytest

from tests.cache._tree_util import one_torch_thread


@pytest.fixture(autouse=True)
def _one_torch_thread():
    with one_torch_thread():
        yield
