"""Smoke test: the map-write microbenchmark runs every way, checks what it wrote, and reports
ratios over pwrite."""

from __future__ import annotations

import os

import pytest

from tests.benchmarks import _load


def load_bench():
    return _load.load_bench("bench_map_write")


def test_every_way_runs_and_is_checked(tmp_path, capsys):
    bench = load_bench()
    results = bench.main(
        ["--mib", "3", "--chunk-mib", "0.75", "--repeats", "2", "--dir", str(tmp_path)]
    )
    assert [r.way for r in results] == list(bench.WAYS)
    assert all(r.gbps > 0 and len(r.samples_gbps) == 2 for r in results)
    assert results[0].ratio == pytest.approx(1.0)
    for r in results[1:]:
        assert r.ratio == pytest.approx(r.gbps / results[0].gbps)
    out = capsys.readouterr().out
    assert all(way in out for way in bench.WAYS) and "vs pwrite" in out
    assert list(tmp_path.iterdir()) == []  # every file and folder removed


def test_a_wrong_write_is_caught(tmp_path, monkeypatch):
    bench = load_bench()
    real = os.pwrite

    def flipped(fd, data, offset):
        buf = bytearray(data)
        buf[0] ^= 0xFF
        return real(fd, bytes(buf), offset)

    monkeypatch.setattr(bench.os, "pwrite", flipped)
    with pytest.raises(SystemExit, match=r"CORRECTNESS FAILURE \[pwrite\]"):
        bench.main(["--mib", "1", "--chunk-mib", "0.5", "--repeats", "1", "--dir", str(tmp_path)])


@pytest.mark.parametrize("bad", [["--mib", "0"], ["--repeats", "0"], ["--chunk-mib", "0"]])
def test_bad_arguments_exit_2(bad, capsys):
    bench = load_bench()
    with pytest.raises(SystemExit) as exc:
        bench.main(bad)
    assert exc.value.code == 2 and bad[0] in capsys.readouterr().err
