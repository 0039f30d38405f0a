"""``engine_fork``'s rule: which runs may be forked from the host that imported vLLM."""

from __future__ import annotations

from tests.vllm.engine_fork import _import_time_changes

BASE = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "PATH": "/usr/bin"}


def test_engine_start_variables_and_unrelated_ones_fork():
    env = {
        **BASE,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",  # read by Mooncake's client, in the child
        "PYTEST_CURRENT_TEST": "x",
    }
    assert _import_time_changes(env, BASE) == []


def test_a_variable_an_import_may_have_read_takes_a_fresh_interpreter():
    assert _import_time_changes({**BASE, "VLLM_CPU_KVCACHE_SPACE": "2"}, BASE) == [
        "VLLM_CPU_KVCACHE_SPACE"
    ]
    assert _import_time_changes({**BASE, "OMP_NUM_THREADS": "1"}, BASE) == ["OMP_NUM_THREADS"]
    without = {k: v for k, v in BASE.items() if k != "HF_HUB_OFFLINE"}
    assert _import_time_changes(without, BASE) == ["HF_HUB_OFFLINE"]
