"""The page-transfer launchers: one signature for every backend, and every backend writes the
bytes of the torch reference, for every direction, copy-order hint and choice of layers.

Sizes are deliberately irregular (37 tokens, parts of 30 and 18 elements, 5 layers, 83 device
rows) and every byte starts random and non-zero (``_transfer_util``)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest
import torch

from tests.host.conftest import torch_threads
from tests.kernels._transfer_util import LAYERS, assert_same_bytes, make_transfer
from tiered_kv.kernels import PlanCache, alloc_kernels, transfer_kernels
from tiered_kv.platform import KernelBackend

CPU = torch.device("cpu")
BACKENDS = ("torch", "native", "triton")
# None: every layer; one layer (a layer-wise load); a subset out of order.
LAYER_CHOICES = (None, [3], [4, 0, 2])


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with torch_threads(1):  # small tensors: torch's worker threads only spin (tests/host too)
        yield


def test_every_transfer_backend_has_the_same_launcher_signature():
    signatures = {b: inspect.signature(transfer_kernels(CPU, b).transfer_rows) for b in BACKENDS}
    for backend, sig in signatures.items():
        assert sig == signatures["torch"], f"{backend}: {sig} != {signatures['torch']}"
    params = signatures["torch"].parameters
    assert params["plan_cache"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["plan_cache"].default is None and params["layers"].default is None


@pytest.mark.parametrize("launcher", ("alloc_extend", "alloc_decode"))
def test_every_alloc_backend_has_the_same_launcher_signature(launcher):
    ref = inspect.signature(getattr(alloc_kernels(CPU, "torch"), launcher))
    assert inspect.signature(getattr(alloc_kernels(CPU, "triton"), launcher)) == ref


@pytest.mark.parametrize("layers", LAYER_CHOICES, ids=("all", "one", "subset"))
@pytest.mark.parametrize("token_major", (False, True))
@pytest.mark.parametrize("to_host", (True, False), ids=("to_host", "to_device"))
@pytest.mark.parametrize("backend", ("native", "triton"))
def test_backend_writes_the_reference_bytes(backend, to_host, token_major, layers, gen):
    n = 37 if backend == "native" else 5  # the interpreter costs ~1 ms per copied row
    got = make_transfer(gen, n=n)
    expected = got.clone_state()
    kernels = transfer_kernels(CPU, backend)
    assert kernels.backend is KernelBackend(backend)
    kw = {"layers": layers, "token_major": token_major}
    got.run(kernels.transfer_rows, to_host, plan_cache=PlanCache(), **kw)
    expected.reference(to_host, **kw)
    assert_same_bytes(got, expected)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float8_e4m3fn))
@pytest.mark.parametrize("to_host", (True, False), ids=("to_host", "to_device"))
def test_native_equal_widths_and_other_dtypes(to_host, dtype, gen):
    """One block size for every part (no per-block sizes array), and 1-, 2-, 4-byte elements."""
    got = make_transfer(gen, items=((2, 7), (2, 7)), dtype=dtype, index_dtype=torch.int32)
    expected = got.clone_state()
    got.run(transfer_kernels(CPU, "native").transfer_rows, to_host, token_major=True)
    expected.reference(to_host)
    assert_same_bytes(got, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_rows_change_nothing(backend, gen):
    got = make_transfer(gen, n=0)
    expected = got.clone_state()
    for to_host in (True, False):
        got.run(transfer_kernels(CPU, backend).transfer_rows, to_host, plan_cache=PlanCache())
    assert_same_bytes(got, expected)


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_backends_without_plans_leave_the_cache_empty(backend, gen):
    got = make_transfer(gen, n=3)
    cache = PlanCache()
    for layer in range(LAYERS):
        got.run(
            transfer_kernels(CPU, backend).transfer_rows, False, layers=[layer], plan_cache=cache
        )
    assert cache.entries == {}
