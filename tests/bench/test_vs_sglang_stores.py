"""The store comparison's pieces: every arm runs every round, ratios go over the right baseline,
the raw reads check what they read, and the slab layout runs through the storage benchmark."""

from __future__ import annotations

import pytest

from tiered_kv.bench import sglang_peer, storage, vs_sglang_stores
from tiered_kv.bench.raw_read import RAW_OPS, raw_read_times
from tiered_kv.bench.vs_sglang_stores import StoreRow, add_ratios, grade, measure_stores


def test_every_round_runs_every_arm_and_rows_are_medians(tmp_path, monkeypatch):
    calls: list[str] = []
    times = {"slab": 1.0, "lmdb": 2.0, "hicache": 4.0}

    def fake_store(case, kind, *a, **k):
        calls.append(kind)
        t = times[kind]
        return {"set": (t, None), "warm_get": (t / 2, None), "cold_get": (t, 0.0)}

    def fake_raw(case, *a, **k):
        calls.append("raw")
        return {"raw_buffered": (2.0, 0.0), "raw_buffered_chunks": (1.0, 0.0)}

    monkeypatch.setattr(vs_sglang_stores, "kv_store_times", fake_store)
    monkeypatch.setattr(vs_sglang_stores, "raw_read_times", fake_raw)
    rows = measure_stores(
        [0.0625], 0.25, workdir=str(tmp_path), batch=2, repeats=3, seed=0, cold=True,
        hicache=True, drop=lambda: True,
    )  # fmt: skip
    assert sorted(calls) == sorted(["slab", "lmdb", "hicache", "raw"] * 3)
    assert calls[:4] != calls[4:8]  # rounds rotate which arm goes first
    by = {(r.store, r.op): r for r in rows}
    assert by[("slab", "set")].ratio == pytest.approx(4.0) and by[("slab", "set")].repeats == 3
    assert by[("lmdb", "warm_get")].ratio == pytest.approx(2.0)
    assert by[("slab", "cold_get")].baseline == "raw raw_buffered_chunks"
    assert by[("slab", "cold_get")].ratio == pytest.approx(1.0)
    assert by[("hicache", "set")].ratio is None
    verdicts = {(g["store"], g["op"]): g["result"] for g in grade(rows)}
    assert verdicts[("slab", "set")] == "PASS" and verdicts[("lmdb", "cold_get")] == "MISS"


def test_ratios_without_the_peer_grade_cold_gets_only():
    rows = [
        StoreRow(2.0, "slab", "set", 1, 1, 3.0, None, None, 1, None),
        StoreRow(2.0, "slab", "cold_get", 1, 1, 1.5, None, None, 1, None),
        StoreRow(2.0, "raw", "raw_odirect", 1, 1, 2.0, None, None, 1, None),
    ]
    add_ratios(rows)
    assert rows[0].ratio is None
    assert rows[1].ratio == pytest.approx(0.75) and rows[1].baseline == "raw raw_odirect"
    assert [g["result"] for g in grade(rows)] == ["MISS"]


@pytest.mark.parametrize("size_mib", [0.0625, 0.0625 + 1 / 1024])
def test_raw_reads_read_back_the_written_bytes(tmp_path, size_mib):
    case = storage.make_case(size_mib, 0.25, seed=0)
    got = raw_read_times(case, str(tmp_path), drop=lambda: True)
    aligned = case.page_nbytes % 4096 == 0
    assert set(got) == set(RAW_OPS) if aligned else set(got) == set(RAW_OPS) - {"raw_odirect"}
    assert (case.dst_rows() == case.src_rows()).all()
    assert not list(tmp_path.iterdir())  # the file is removed


@pytest.mark.parametrize("kind", ["slab", "lmdb"])
def test_both_layouts_run_through_the_storage_benchmark(tmp_path, kind):
    case = storage.make_case(0.0625, 0.5, seed=1)
    got = storage.kv_store_times(
        case, kind, str(tmp_path), 3, storage.LMDB_DEFAULTS, False, True, lambda: True
    )
    assert set(got) == {"set", "warm_get", "cold_get"} and all(s > 0 for s, _ in got.values())
    full = storage.full_set_times(case, kind, str(tmp_path), 3, storage.LMDB_DEFAULTS, False)
    assert full["full_set"][0] > 0


def test_hicache_file_round_trips_where_sglang_is_installed(tmp_path):
    peer = sglang_peer.find_sglang()
    if isinstance(peer, str) or peer.storage is None:
        pytest.skip(peer if isinstance(peer, str) else "HiCacheFile did not import")
    case = storage.make_case(0.0625, 0.25, seed=2)
    got = storage.kv_store_times(case, "hicache", str(tmp_path), 2, {}, False, True, lambda: True)
    assert set(got) == {"set", "warm_get", "cold_get"}
