"""Smoke test: the side-by-side benchmark's allocator and store parts run quickly against ours
alone (SGLang is not installed here) and say so; with --require-sglang it exits 3."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks import _load
from tiered_kv.bench import sglang_peer


def load_bench():
    return _load.load_bench("bench_vs_sglang")


pytestmark = pytest.mark.skipif(
    not isinstance(sglang_peer.find_sglang(), str), reason="SGLang is installed: not this test"
)


def test_quick_run_without_sglang_times_ours_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TIERED_KV_DEBUG", raising=False)  # time the production default
    bench = load_bench()
    out = tmp_path / "vs.json"
    results = bench.main(["--quick", "--only", "allocators", "--json", str(out)])
    rows = results["allocators"]
    cells = {(r.allocator, r.page_size, r.batch, r.op) for r in rows}
    # Quick: token + paged at page sizes 1 and 16, batches 1 and 64, three ops each.
    assert len(cells) == len(rows) == 3 * 2 * 3
    assert all(r.ours_us > 0 and r.sglang_us is None and r.ratio is None for r in rows)
    printed = capsys.readouterr().out
    assert "SGLang is not installed here" in printed and "Timing ours alone" in printed
    assert "ours_us" in printed and "load average" in printed
    data = json.loads(out.read_text())
    assert len(data["allocators"]) == len(rows) and data["machine"]["sglang"] is None


def test_quick_store_part_without_sglang_times_both_layouts(tmp_path, capsys):
    bench = load_bench()
    out = tmp_path / "vs.json"
    argv = ["--quick", "--only", "stores", "--no-drop-cache", "--store-dir", str(tmp_path)]
    rows = bench.main([*argv, "--json", str(out)])["stores"]
    assert {(r.store, r.op) for r in rows} == {
        (s, op) for s in ("slab", "lmdb") for op in ("set", "warm_get")
    }
    assert all(r.gbps > 0 and r.ratio is None and r.load is not None for r in rows)
    printed = capsys.readouterr().out
    assert "HiCacheFile not importable" in printed and "(--no-drop-cache)" in printed
    assert len(json.loads(out.read_text())["stores"]) == len(rows)
    assert list(tmp_path.iterdir()) == [out]  # the work dir is removed


def test_require_sglang_exits_3(capsys):
    bench = load_bench()
    with pytest.raises(SystemExit) as info:
        bench.main(["--quick", "--require-sglang"])
    assert info.value.code == bench.EXIT_NO_SGLANG == 3
    assert "SGLang is not installed here" in capsys.readouterr().out


def test_cells_and_pool():
    from tiered_kv.bench.allocator import Lengths, pool_size
    from tiered_kv.bench.vs_sglang import EXCLUDED, allocator_cells, pool_tokens

    cells = allocator_cells([1, 16, 64], [1, 64, 256])
    assert len(cells) == 3 + 9 and cells[0].allocator == "token"
    pool = pool_tokens(cells, Lengths(100, 128))
    assert pool % 64 == 0 and all(
        pool >= pool_size(c.batch, c.page_size, Lengths(100, 128)) for c in cells
    )
    assert ("paged", 1, "alloc_decode") in EXCLUDED
