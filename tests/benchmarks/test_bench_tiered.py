"""Smoke test: the layer-wise loading benchmark runs, verifies bytes and reports every layout."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks import _load


def test_bench_tiered_small_run(tmp_path, capsys):
    bench = _load.load_bench("bench_tiered")
    out = tmp_path / "tiered.json"
    argv = ["--tokens", "96", "--layers", "5", "--heads", "2", "--head-dim", "16"]
    assert bench.main([*argv, "--page-size", "8", "--repeats", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["layout"] for r in rows] == ["page_first", "layer_first"]
    for r in rows:
        assert r["repeats"] == 2 and r["layers"] == 5
        assert 0 < r["layer0_ms"] <= r["all_ms"]
        assert r["full_ms"] > 0
    assert "layer0*L/full" in capsys.readouterr().out


def test_bench_tiered_rejects_unaligned_tokens():
    bench = _load.load_bench("bench_tiered")
    with pytest.raises(SystemExit):
        bench.main(["--tokens", "100", "--page-size", "16"])
