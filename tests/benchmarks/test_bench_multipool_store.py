"""Smoke test: the multi-pool store benchmark runs both layouts, checks every page read back and
prints its table."""

from __future__ import annotations

import pytest

from tests.benchmarks import _load


def test_bench_multipool_store_small_run(capsys):
    bench = _load.load_bench("bench_multipool_store")
    argv = ["--pages", "1,3", "--layers", "2", "--page-size", "4", "--kv-lora-rank", "16"]
    assert bench.main([*argv, "--rope", "8", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "one value get ms" in out and "per part get ms" in out
    assert len([line for line in out.splitlines() if line.strip().startswith(("1 ", "3 "))]) == 2


def test_bench_multipool_store_rejects_bad_pages():
    bench = _load.load_bench("bench_multipool_store")
    with pytest.raises(SystemExit):
        bench.main(["--pages", "0"])
