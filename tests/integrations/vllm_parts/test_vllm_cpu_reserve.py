"""The warning when vLLM's CPU build, with a KV connector configured, leaves its engine core no
core (``cpu_reserve``), on stand-in configs."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from tiered_kv.integrations.vllm import cpu_reserve as cr


def config(device="cpu", tp=1, pp=1, connector=True):
    return SimpleNamespace(
        device_config=SimpleNamespace(device_type=device),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        kv_transfer_config=SimpleNamespace() if connector else None,
    )


@pytest.mark.parametrize(
    ("cores", "tp", "connector", "env", "warns"),
    [
        (2, 1, True, {}, True),  # the 2-core case measured: 2 wanted of 2 -> none reserved
        (2, 1, False, {}, False),  # without a connector vLLM wants 1 of 2
        (3, 1, True, {}, False),
        (4, 2, True, {}, True),  # 2 workers x 2 cores, 4 wanted
        (8, 2, True, {}, False),
        (2, 1, True, {cr.ENV: "1"}, False),  # the fix
        (2, 1, True, {cr.ENV: "2"}, True),  # asked for every core
        (2, 1, True, {cr.ENV: "0"}, False),  # no reservation, chosen
        (2, 1, True, {cr.BIND_ENV: "0"}, False),  # explicit binding: vLLM reserves nothing
    ],
)
def test_the_engine_core_without_a_core_is_named_with_the_fix(cores, tp, connector, env, warns):
    found = cr.cpu_reservation(config(tp=tp, connector=connector), env=env, cores=cores)
    message = None if found is None else found.warning()
    assert (message is not None) == warns, (found, message)
    if warns:
        assert cr.ENV in message and f"{cores // tp} core(s) each" in message, message


def test_not_the_cpu_build_says_nothing():
    assert cr.cpu_reservation(config(device="cuda"), env={}, cores=2) is None


def test_warned_once_per_process(monkeypatch, caplog):
    monkeypatch.setattr(cr, "_warned", False)
    monkeypatch.delenv(cr.ENV, raising=False)
    monkeypatch.delenv(cr.BIND_ENV, raising=False)
    monkeypatch.setattr(cr.psutil, "cpu_count", lambda logical=True: 2)
    log = logging.getLogger("test.cpu_reserve")
    with caplog.at_level(logging.WARNING, logger="test.cpu_reserve"):
        first = cr.warn_once(config(), log)
        second = cr.warn_once(config(), log)
    assert first is not None and first == second
    assert [r.getMessage() for r in caplog.records] == [f"TieredKVConnector: {first}"]
    monkeypatch.setenv(cr.ENV, "not a number")
    assert cr.warn_once(config(), log) is None  # a value vLLM itself would refuse: no guess
