"""The storage measurement's pieces: stores run in a fixed order each round, a host pool can be
the page source (as ``tiered-kv bench`` uses it), and a wrong get is caught."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.bench import storage, storage_suite, transfer
from tiered_kv.bench.page_stores import FileStore
from tiered_kv.bench.verify import fill_random
from tiered_kv.errors import StateError

CPU = torch.device("cpu")


def test_every_round_runs_lmdb_then_files_then_odirect(tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(
        storage_suite, "kv_store_times", lambda c, kind, *a, **k: calls.append(kind) or {}
    )
    monkeypatch.setattr(storage_suite, "full_set_times", lambda *a, **k: {})
    monkeypatch.setattr(storage_suite, "odirect_times", lambda *a: calls.append("odirect") or {})
    storage_suite.measure_sizes(
        [0.0625], 0.25, workdir=str(tmp_path), batch=2, repeats=2, seed=0, fsync=False,
        cold=False, notes=[],
    )  # fmt: skip
    assert calls == ["lmdb", "files", "odirect"] * 2


def _host(tokens: int = 32, page: int = 8):
    geom = transfer.Geometry(layers=2, heads=1, head_dim=8, dtype=torch.float16)
    pool = transfer.make_pool(geom, tokens, page, CPU)
    alloc = transfer.make_allocator(pool, tokens)
    host = transfer.make_host(pool.host_pool_decls()[0], alloc, "page_first", tokens)
    fill_random([host.buffer], 0, CPU)
    return host


@pytest.mark.parametrize("kind", ["lmdb", "files"])
def test_host_pages_round_trip_through_a_store(kind, tmp_path):
    host = _host()
    try:
        case = storage.host_case(host, 2, seed=0)
        got = storage.kv_store_times(case, kind, str(tmp_path), 2, {}, False, False)
        assert set(got) == {"set", "warm_get"} and all(s > 0 for s, _ in got.values())
        assert (case.dst_rows() == case.src_rows()).all()
        assert case.dst_first == 2 and case.src_first == 0
    finally:
        host.destroy()


def test_a_wrong_get_is_a_check_failure(tmp_path, monkeypatch):
    case = storage.make_case(0.0625, 0.25, seed=0)
    real = FileStore.batch_get

    def lossy(self, keys, source, pages):
        out = real(self, keys, source, pages)
        source.page_bytes_rows()[pages[-1], 3] ^= 0xFF
        return out

    monkeypatch.setattr(FileStore, "batch_get", lossy)
    with pytest.raises(StateError, match=r"CORRECTNESS FAILURE \[size=0.0625 MiB store=files"):
        storage.kv_store_times(case, "files", str(tmp_path), 2, {}, False, False)
