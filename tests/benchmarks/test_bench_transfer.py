"""Smoke test: the transfer benchmark runs, verifies every configuration and reports every row."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks import _load

TINY = [
    *("--layers", "2", "--heads", "2", "--head-dim", "16"),
    *("--tokens", "64", "--pool-tokens", "256", "--repeats", "2", "--page-sizes", "1,16"),
]


def load_bench():
    return _load.load_bench("bench_transfer")


def test_bench_transfer_small_run(tmp_path, capsys):
    bench = load_bench()
    out = tmp_path / "rows.json"
    rows = bench.main([*TINY, "--kernel-backends", "native,torch", "--json", str(out)])
    keys = {(r.layout, r.page_size, r.io_backend, r.kernel_backend, r.direction) for r in rows}
    # 3 layouts x 2 page sizes x (kernel/native, kernel/torch, direct/-) x 3 directions
    assert len(keys) == len(rows) == 3 * 2 * 3 * 3
    assert {r.kernel_backend for r in rows if r.io_backend == "direct"} == {"-"}
    assert all(r.verified and r.median_ms > 0 and r.gbps > 0 for r in rows)
    assert all(r.baseline_gbps > 0 and r.ratio > 0 and r.nbytes == 64 * 2 * 128 for r in rows)
    assert all(len(r.samples_ms) == len(r.baseline_samples_ms) == 2 for r in rows)
    targets = [r for r in rows if r.target is not None]
    assert {(r.layout, r.page_size) for r in targets} == {("page_first", 16)}
    assert all(r.target == ("PASS" if r.ratio >= 0.8 else "MISS") for r in targets)
    data = json.loads(out.read_text())
    assert len(data["rows"]) == len(rows)
    assert data["config"] and {"cpu_count", "python", "versions"} <= set(data["machine"])
    printed = capsys.readouterr().out
    assert "correctness: all 18 configurations verified" in printed
    assert "target: page_first" in printed and "native block copier available" in printed


def test_bench_transfer_mla_and_verification_catches_corruption(monkeypatch, capsys):
    bench = load_bench()
    rows = bench.main([*TINY, "--mla", "--kv-lora-rank", "32", "--qk-rope-head-dim", "8"])
    assert rows and all(r.nbytes == 64 * 2 * 40 * 2 for r in rows)

    # A backup that drops its last token must abort the run with a clear message.
    original = bench.HostKVCache.backup_from_device_all_layer

    def lossy(self, pool, host_indices, device_indices, io_backend="kernel"):
        original(self, pool, host_indices[:-1], device_indices[:-1], io_backend)

    monkeypatch.setattr(bench.HostKVCache, "backup_from_device_all_layer", lossy)
    argv = [*TINY, "--layouts", "page_first", "--page-sizes", "1", "--io-backends", "direct"]
    with pytest.raises(SystemExit, match=r"CORRECTNESS FAILURE \[layout=page_first page_size=1"):
        bench.main(argv)


def test_bench_transfer_triton_rows_are_tiny_and_not_targets(capsys):
    bench = load_bench()
    argv = [*TINY, "--layouts", "page_first", "--page-sizes", "16", "--io-backends", "kernel"]
    rows = bench.main([*argv, "--kernel-backends", "torch", "--with-triton"])
    triton = [r for r in rows if r.kernel_backend == "triton"]
    assert len(triton) == 3 and all(r.interpreted and r.target is None for r in triton)
    assert all(r.tokens == 16 and r.repeats == 2 and r.verified for r in triton)
    assert "under the interpreter at 16 tokens" in capsys.readouterr().out
