"""Smoke test: the HiSparse serving benchmark serves the same turns both ways with the same
tokens and bitwise logits, a HiSparse request holding only its buffer and a page."""

from __future__ import annotations

import json

from tests.benchmarks import _load


def test_bench_hisparse_serving_small_run(tmp_path, capsys):
    bench = _load.load_bench("bench_hisparse_serving")
    out = tmp_path / "hs.json"
    argv = ["--convos", "2", "--turns", "2", "--system", "24", "--user", "9", "--decode", "6"]
    argv += ["--buffer", "16", "--topk", "6", "--json", str(out)]
    assert bench.main(argv) == 0
    dense, sparse = json.loads(out.read_text())["rows"]
    assert dense["way"] == "dense" and sparse["way"] == "hisparse"
    assert dense["same"] and sparse["same"]
    assert sparse["peak"] == 16 + 8  # the buffer and a page, whatever the context
    assert dense["peak"] > sparse["peak"] and sparse["h2d_mib_turn"] > 0
    assert "V3.2 MiB/req" in capsys.readouterr().out
