"""Smoke test: the connector's per-block benchmark runs, checks every load's bytes and grades
each op against its baseline; a load that serves other bytes fails it."""

from __future__ import annotations

import json

import pytest
import torch

from tests.benchmarks import _load
from tiered_kv.bench import connector_blocks as cb
from tiered_kv.errors import TransferError


def test_bench_connector_blocks_small_run(tmp_path, capsys):
    bench = _load.load_bench("bench_connector_blocks")
    out = tmp_path / "blocks.json"
    argv = ["--layers", "3", "--heads", "2", "--head-dim", "24", "--block-size", "5"]
    argv += ["--dtype", "float32", "--blocks", "3", "--rounds", "2", "--json", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["op"] for r in rows] == list(cb.OPS)
    for r in rows:
        assert r["blocks"] == 3 and r["rounds"] == 2
        assert r["us_per_block"] > 0 and r["baseline_us_per_block"] > 0
        assert r["ratio"] == pytest.approx(r["us_per_block"] / r["baseline_us_per_block"])
    text = capsys.readouterr().out
    assert "raw warm read" in text and "threads: torch" in text and "load average at end" in text


def test_a_load_of_wrong_bytes_fails_the_run(monkeypatch):
    real = cb.ConnectorTiers.load

    def damaged(self, blocks, digests, on_layer=None):
        failed = real(self, blocks, digests, on_layer)
        for t in self.layout.rows[0][:1]:
            t[blocks[0]].view(torch.uint8).view(-1)[7] ^= 0x10  # one bit of one loaded block
        return failed

    monkeypatch.setattr(cb.ConnectorTiers, "load", damaged)
    with pytest.raises(TransferError, match="differs|!="):
        cb.measure(cb.Geometry(2, 2, 8, 4, torch.float32), 2, 1)


@pytest.mark.parametrize("flag", ["--blocks", "--rounds", "--layers"])
def test_bad_sizes_are_refused(flag, capsys):
    bench = _load.load_bench("bench_connector_blocks")
    with pytest.raises(SystemExit):
        bench.main([flag, "0"])
    assert f"{flag} must be >= 1" in capsys.readouterr().err
