"""Smoke test: the merged-prefetch benchmark runs, checks every request's hit and reports one
storage job for the batch against one per request."""

from __future__ import annotations

import json

from tests.benchmarks import _load


def test_bench_merged_prefetch_small_run(tmp_path, capsys):
    bench = _load.load_bench("bench_merged_prefetch")
    out = tmp_path / "merged.json"
    argv = ["--requests", "3", "--tokens", "25", "--layers", "2", "--heads", "2"]
    argv += ["--head-dim", "8", "--page-size", "4", "--repeats", "2", "--json", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["way"] for r in rows] == ["merged", "per request"]
    merged, separate = rows
    assert merged["jobs"] == 1 and separate["jobs"] == 3
    assert merged["gets"] == 1 and separate["gets"] == 3
    assert all(r["pages"] == 18 and r["repeats"] == 2 and r["ms"] > 0 for r in rows)
    assert "per-req/merged" in capsys.readouterr().out
