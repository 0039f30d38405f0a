"""Smoke test: the allocation benchmark runs, verifies both backends and reports every row."""

from __future__ import annotations

import json

from tests.benchmarks import _load


def load_bench():
    return _load.load_bench("bench_allocator")


def test_bench_allocator_small_run(tmp_path, capsys):
    bench = load_bench()
    out = tmp_path / "rows.json"
    argv = ["--batch-sizes", "1,3", "--page-sizes", "1,16", "--repeats", "2"]
    rows = bench.main([*argv, "--backends", "torch,triton", "--json", str(out)])
    ops = {(r.backend, r.page_size, r.batch, r.op) for r in rows}
    assert len(ops) == 2 * 2 * 2 * 3
    assert all(r.median_us > 0 for r in rows)
    data = json.loads(out.read_text())
    assert len(data["rows"]) == len(rows)
    assert data["config"] and {"cpu_count", "python", "versions"} <= set(data["machine"])
    printed = capsys.readouterr().out
    assert "ratio triton/torch" in printed and "correctness: all configurations verified" in printed
