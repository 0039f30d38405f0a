"""Smoke test: the remote-store benchmark measures each backend's store and raw client on its
own server at tiny, irregular sizes, checks every get, reports ratios and targets, and stops
at a wrong byte. Mooncake's rows need a loopback-only network namespace (see
tests/storage/mooncake_server); elsewhere the script notes they were not measured."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks import _load
from tests.storage.mooncake_server import require_mooncake

TINY = ["--sizes", "0.0625,0.1", "--total-mib", "0.5", "--batch", "3", "--repeats", "2"]


def load_bench():
    return _load.load_bench("bench_remote_stores")


def _check_rows(rows, backend: str) -> None:
    mine = [r for r in rows if r.backend == backend]
    cells = {(round(r.size_mib, 4), r.op) for r in mine}
    assert cells == {(s, op) for s in (0.0625, 0.1) for op in ("set", "get")}
    for r in mine:
        assert r.nbytes == r.pages * round(r.size_mib * 2**20)
        assert r.pages == round(0.5 / round(r.size_mib, 4))
        assert len(r.samples_s) == len(r.raw_samples_s) == 2
        assert r.gbps > 0 and r.raw_gbps > 0
        assert r.ratio == pytest.approx(r.gbps / r.raw_gbps)


def test_bench_remote_stores_redis(tmp_path, capsys):
    out = tmp_path / "report.json"
    rep = load_bench().main([*TINY, "--backends", "redis", "--json", str(out)])
    _check_rows(rep.rows, "redis")
    assert len(rep.rows) == 4 and len(rep.targets) == 4
    assert all(t["result"] == ("PASS" if t["ratio"] >= 0.9 else "MISS") for t in rep.targets)
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 4 and "load_after" in data["machine"]
    printed = capsys.readouterr().out
    assert "vs raw" in printed and "targets: every store's set / get >= 0.9x" in printed


def test_bench_remote_stores_mooncake(tmp_path):
    require_mooncake()
    rep = load_bench().main([*TINY, "--backends", "mooncake"])
    _check_rows(rep.rows, "mooncake")
    assert not rep.notes


def test_bench_remote_stores_outside_a_namespace_notes_mooncake_unmeasured(monkeypatch):
    bench = load_bench()
    monkeypatch.setattr(bench, "loopback_only", lambda: False)
    rep = bench.main([*TINY, "--backends", "mooncake", "--sizes", "0.0625"])
    assert rep.rows == [] and any("mooncake not measured" in n for n in rep.notes)


def test_bench_remote_stores_catches_a_wrong_get_of_the_store(monkeypatch):
    from tiered_kv.storage.redis_store import RedisStorage

    original = RedisStorage.batch_get

    def lossy(self, keys, source, pages):
        out = original(self, keys, source, pages)
        source.array[pages[-1], 7] ^= 0x10
        return out

    monkeypatch.setattr(RedisStorage, "batch_get", lossy)
    with pytest.raises(SystemExit, match=r"CORRECTNESS FAILURE \[redis store"):
        load_bench().main([*TINY, "--backends", "redis", "--sizes", "0.0625"])


def test_bench_remote_stores_catches_a_wrong_get_of_the_raw_client(monkeypatch):
    bench = load_bench()
    original = bench.redis_pair

    def lossy_pair(url, pages):
        pair = original(url, pages)
        get = pair.raw_get

        def raw_get(names, dst):
            out = get(names, dst)
            pages.array[dst[0], -1] ^= 0x01
            return out

        pair.raw_get = raw_get
        return pair

    monkeypatch.setattr(bench, "redis_pair", lossy_pair)
    with pytest.raises(SystemExit, match=r"CORRECTNESS FAILURE \[redis raw client"):
        bench.main([*TINY, "--backends", "redis", "--sizes", "0.0625"])
