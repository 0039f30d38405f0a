"""Smoke test: the layer-wise loading benchmark runs, verifies bytes and reports every layout."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks import _load


def test_bench_tiered_small_run(tmp_path, capsys):
    bench = _load.load_bench("bench_tiered")
    out = tmp_path / "tiered.json"
    argv = ["--tokens", "96", "--layers", "5", "--heads", "2", "--head-dim", "16"]
    argv += ["--requests", "3"]
    assert bench.main([*argv, "--page-size", "8", "--repeats", "2", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    rows = payload["rows"]
    assert [r["layout"] for r in rows] == ["page_first", "layer_first"]
    for r in rows:
        assert r["repeats"] == 2 and r["layers"] == 5
        assert 0 < r["layer0_ms"] <= r["all_ms"]
        assert r["full_ms"] > 0
    batches = payload["batches"]
    assert [b["layout"] for b in batches] == ["page_first", "layer_first"]
    for b in batches:
        assert b["requests"] == 3 and b["tokens"] == 96 and b["repeats"] == 2
        assert 0 < b["merged_layer0_ms"] <= b["merged_all_ms"]
        assert 0 < b["separate_layer0_ms"] <= b["separate_all_ms"]
    out_text = capsys.readouterr().out
    assert "layer0*L/full" in out_text and "merged layer0*L/full" in out_text


def test_batch_lengths_are_irregular_whole_pages():
    from tiered_kv.bench.batched_loads import split_tokens
    from tiered_kv.errors import InvalidArgumentError

    for seed in range(20):
        n = split_tokens(4096, 8, 16, seed)
        assert sum(n) == 4096 and len(n) == 8 and all(x > 0 and x % 16 == 0 for x in n)
    assert len(set(split_tokens(4096, 8, 16, 3))) > 1
    with pytest.raises(InvalidArgumentError, match="requests=9"):
        split_tokens(128, 9, 16, 0)


def test_bench_tiered_rejects_unaligned_tokens():
    bench = _load.load_bench("bench_tiered")
    with pytest.raises(SystemExit):
        bench.main(["--tokens", "100", "--page-size", "16"])
    with pytest.raises(SystemExit):
        bench.main(["--tokens", "32", "--page-size", "16", "--requests", "3"])
