"""Smoke test: the hybrid-state benchmark runs (quick mode, a tiny geometry), verifies every
restore, reports every tier with the full model holding more bytes; a wrong byte aborts it."""

from __future__ import annotations

import json

import pytest
import torch

from tests.benchmarks import _load
from tiered_kv.bench import hybrid_state

TINY = [
    "--layers", "8", "--heads", "2", "--head-dim", "16", "--page-size", "16",
    "--linear-heads", "2", "--key-dim", "16", "--value-dim", "8", "--repeats", "2",
]  # fmt: skip


def test_bench_hybrid_state_quick_run(tmp_path, capsys):
    bench = _load.load_bench("bench_hybrid_state")
    out = tmp_path / "hybrid.json"
    assert bench.main(["--quick", *TINY, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tokens"], r["tier"]) for r in rows] == [
        (t, tier) for t in (1024, 4096) for tier in ("device", "host", "storage")
    ]
    for r in rows:
        assert r["bytes_ratio"] > 1 and r["full_bytes"] > r["hybrid_bytes"] > 0
        assert 0 < r["hybrid_state_bytes"] < r["hybrid_bytes"]
        assert r["hybrid_ms"] > 0 and r["full_ms"] > 0
        assert len(r["hybrid_samples_ms"]) == len(r["full_samples_ms"]) == 2
    device = [r for r in rows if r["tier"] == "device"]
    assert device[1]["bytes_ratio"] > device[0]["bytes_ratio"]  # the state is O(1)
    printed = capsys.readouterr().out
    assert "full/hybrid" in printed and "load average before" in printed


@pytest.mark.parametrize("what", ["kv", "state"])
def test_a_wrong_byte_aborts_the_run(monkeypatch, what):
    """The negative control: the restore check can fail (one reference bit flipped)."""
    bench = _load.load_bench("bench_hybrid_state")
    real = hybrid_state.cache_prefix

    def flipped(*args, **kwargs):
        p = real(*args, **kwargs)
        if p.hybrid:
            t = p.state[-1] if what == "state" else next(iter(p.kv.values()))[1]
            t.view(torch.uint8).view(-1)[7] ^= 1
        return p

    monkeypatch.setattr(hybrid_state, "cache_prefix", flipped)
    with pytest.raises(SystemExit, match="CORRECTNESS FAILURE"):
        bench.main([*TINY, "--tokens", "64", "--repeats", "1"])
