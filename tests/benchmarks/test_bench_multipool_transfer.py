"""Smoke test: the multi-pool transfer benchmark moves DSA and SWA pages, checks their bytes and
prints both rows against a contiguous copy."""

from __future__ import annotations

import pytest

from tests.benchmarks import _load


def test_bench_multipool_transfer_small_run(capsys):
    bench = _load.load_bench("bench_multipool_transfer")
    argv = ["--tokens", "32", "--layers", "4", "--page-size", "16", "--repeats", "2"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith(("dsa ", "swa "))]
    assert rows == ["dsa", "swa"] and "backup/copy" in out


def test_bench_multipool_transfer_rejects_partial_pages():
    bench = _load.load_bench("bench_multipool_transfer")
    with pytest.raises(SystemExit):
        bench.main(["--tokens", "40", "--page-size", "16"])
