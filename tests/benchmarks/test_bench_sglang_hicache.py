"""Smoke test: the SGLang HiCache benchmark runs tiny shapes through SGLang's controller with
both backends, checks every prefetched page and writes its rows; without SGLang it exits 3."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks import _load
from tests.integrations.sglang_stack import sglang_missing


def load_bench():
    return _load.load_bench("bench_sglang_hicache")


@pytest.mark.skipif(sglang_missing() is not None, reason=str(sglang_missing()))
def test_quick_run_measures_both_backends(tmp_path, capsys):
    out = tmp_path / "hicache.json"
    data = load_bench().main(["--quick", "--workdir", str(tmp_path), "--json", str(out)])
    rows = data["rows"]
    assert {(r["model"], r["arm"], r["op"]) for r in rows} == {
        (m, a, op) for m in ("mha", "mla") for a in ("tiered_kv", "hicache_file")
        for op in ("backup", "prefetch")
    }  # fmt: skip
    assert all(r["gbps"] > 0 and r["repeats"] == 2 for r in rows)
    assert all((r["ratio"] is None) == (r["arm"] == "hicache_file") for r in rows)
    printed = capsys.readouterr().out
    assert "ratio" in printed and "load average" in printed
    assert len(json.loads(out.read_text())["rows"]) == 8
    assert list(tmp_path.iterdir()) == [out]  # the stores' directories are removed


@pytest.mark.skipif(sglang_missing() is None, reason="SGLang is installed: not this test")
def test_without_sglang_it_says_so_and_exits_3(capsys):
    bench = load_bench()
    with pytest.raises(SystemExit) as info:
        bench.main(["--quick"])
    assert info.value.code == bench.EXIT_NO_SGLANG == 3
    assert "SGLang is not installed here" in capsys.readouterr().out
