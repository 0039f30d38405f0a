"""Smoke test: the storage benchmark runs every store and op, verifies every get, reports
ratios and targets, and says so when the page cache cannot be dropped (no root needed)."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks import _load

TINY = ["--sizes", "0.0625,0.125", "--total-mib", "1", "--batch", "4", "--repeats", "2"]


def load_bench():
    return _load.load_bench("bench_storage")


def test_bench_storage_small_run_without_cold_get(tmp_path, capsys):
    bench = load_bench()
    out = tmp_path / "report.json"
    argv = [*TINY, "--no-drop-cache", "--dir", str(tmp_path), "--json", str(out)]
    report = bench.main(argv)
    rows = report.rows
    keys = {(r.size_mib, r.store, r.op) for r in rows}
    expected = {(s, st, op) for s in (0.0625, 0.125) for st in ("lmdb", "files")
                for op in ("set", "full_set", "warm_get")}  # fmt: skip
    expected |= {(s, "odirect", op) for s in (0.0625, 0.125) for op in ("set", "cold_get")}
    assert keys == expected and len(rows) == len(keys)
    assert all(r.verified and r.gbps > 0 and r.repeats == 2 and len(r.samples_s) == 2 for r in rows)
    assert all(r.nbytes == r.pages * round(r.size_mib * 2**20) == 2**20 for r in rows)
    for r in rows:
        if r.store == "files":
            assert r.ratio_files == pytest.approx(1.0)
        assert (r.ratio_odirect is None) == (r.op in ("warm_get", "full_set"))
    assert not report.cold_get_measured
    assert any("cold get not measured: cannot drop page cache" in n for n in report.notes)
    graded = [t for t in report.targets if t["result"] in ("PASS", "MISS")]
    assert {(t["size_mib"], t["what"]) for t in graded} == {
        (s, f"lmdb {op} vs files") for s in (0.0625, 0.125) for op in ("set", "warm_get")
    }
    assert all(t["result"] == ("PASS" if t["ratio"] >= 1.0 else "MISS") for t in graded)
    data = json.loads(out.read_text())
    assert len(data["rows"]) == len(rows) and data["cold_get_measured"] is False
    printed = capsys.readouterr().out
    assert "cold get not measured: cannot drop page cache" in printed
    assert "targets: LMDB set" in printed and "page cache drop" in printed
    assert printed.count("lmdb set into a full store vs files") == 2
    assert list(tmp_path.iterdir()) == [out]  # the work dir is removed


def test_bench_storage_cold_get_and_study_with_a_fake_cache_drop(tmp_path, monkeypatch, capsys):
    bench = load_bench()
    monkeypatch.setattr(bench, "drop_page_cache", lambda: True)  # no root: nothing dropped
    argv = ["--sizes", "0.0625", "--total-mib", "0.5", "--batch", "4", "--repeats", "1"]
    report = bench.main([*argv, "--study", "--study-size", "0.0625", "--dir", str(tmp_path)])
    assert report.cold_get_measured
    cold = {r.store for r in report.rows if r.op == "cold_get"}
    assert cold == {"lmdb", "files", "odirect"}
    lmdb_cold = [t for t in report.targets if t["what"] == "lmdb cold_get vs odirect read"]
    assert len(lmdb_cold) == 1 and lmdb_cold[0]["need"] == 0.6
    configs = {r.config for r in report.study}
    assert (
        len(configs) == 11
        and "huge pages on, batch 4" in configs
        and "durable on, batch 4" in configs
        and "defaults, batch 32" in configs
        and "1 I/O thread, batch 4" in configs
    )
    assert len(report.study) == 11 * 3 and all(r.verified for r in report.study)
    assert "LMDB option study at 0.0625 MiB" in capsys.readouterr().out


def test_bench_storage_catches_a_wrong_get(tmp_path, monkeypatch):
    bench = load_bench()
    original = bench.FileStore.batch_get

    def lossy(self, keys, source, pages):
        out = original(self, keys, source, pages)
        source.array[pages[0], 0] ^= 0xFF
        return out

    monkeypatch.setattr(bench.FileStore, "batch_get", lossy)
    argv = [*TINY, "--no-drop-cache", "--dir", str(tmp_path), "--repeats", "1"]
    with pytest.raises(SystemExit, match=r"CORRECTNESS FAILURE \[size=0.0625 MiB store=files"):
        bench.main(argv)
