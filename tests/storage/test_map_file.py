"""The LMDB data file under the map: disk blocks reserved before the map may use them (a full
disk is a counted skip, never a SIGBUS), the fallback without writemap, huge-page advice."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from tiered_kv.storage import LMDBStorage, map_file

from ._util import ByteSource, byte_namespace, fill_for_keys, raw_key

MIB = 1 << 20


def _store(path, nbytes=MIB, budget=256 * MIB, **kw):
    ns = byte_namespace(nbytes)
    return ns, LMDBStorage(path, ns, nbytes, budget_bytes=budget, io_threads=1, **kw)


def _write_and_check(store, ns, nbytes, n, tag="k"):
    """Write n fresh random pages one batch of 4 at a time; every page the store then reports
    present must read back byte for byte."""
    src = ByteSource(nbytes, n)
    keys = [raw_key(ns, f"{tag}{i}") for i in range(n)]
    fill_for_keys(src, keys, range(n))
    ok = []
    for i in range(0, n, 4):
        ok += store.batch_set(keys[i : i + 4], src, list(range(i, min(i + 4, n))))
    dst = ByteSource(nbytes, n)
    dst.buf.random_(0, 256)
    got = store.batch_get(keys, dst, list(range(n)))
    for i, hit in enumerate(got):
        if hit:
            assert torch.equal(dst.buf[i], src.buf[i]), f"page {i} differs"
    return ok, got


def _allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


def test_reserve_allocates_the_blocks(tmp_path):
    f = tmp_path / "data"
    f.write_bytes(b"")
    err = map_file.reserve(f, 8 * MIB + 4096)
    if err in map_file.UNSUPPORTED:
        pytest.skip(f"this file system has no fallocate ({errno.errorcode[err]})")
    assert err == 0
    assert f.stat().st_size == 8 * MIB + 4096 and _allocated(f) >= 8 * MIB + 4096


def test_reserve_of_a_missing_file_returns_its_errno(tmp_path):
    assert map_file.reserve(tmp_path / "nope", MIB) == errno.ENOENT


def test_the_map_is_reserved_as_it_grows(tmp_path):
    ns, store = _store(tmp_path / "s")
    try:
        data = tmp_path / "s" / "data.mdb"
        start = store._env.info()["map_size"]
        if not store._shared.writemap:
            pytest.skip("no fallocate here: the store runs without writemap")
        assert _allocated(data) >= start
        ok, got = _write_and_check(store, ns, MIB, 40)
        assert all(ok) and all(got)
        size = store._env.info()["map_size"]
        assert size > start and store.stats().map_resizes >= 1
        assert _allocated(data) >= size
    finally:
        store.close()


def test_no_room_to_grow_is_counted_and_the_store_keeps_working(tmp_path, monkeypatch):
    real = map_file.reserve
    first = {}

    def no_room_past_the_first_size(path, size):
        first.setdefault(path, size)
        return errno.ENOSPC if size > first[path] else real(path, size)

    monkeypatch.setattr(map_file, "reserve", no_room_past_the_first_size)
    ns, store = _store(tmp_path / "s")
    try:
        start = store._env.info()["map_size"]
        ok, got = _write_and_check(store, ns, MIB, 48)  # 48 MiB into a 32 MiB map
        stats = store.stats()
        assert store._env.info()["map_size"] == start and stats.map_resizes == 0
        assert stats.errors.get("grow map: ENOSPC", 0) >= 1
        assert stats.evictions > 0 and 0 < stats.pages < 48
        assert any(got) and got[-1]  # the newest pages stay; every hit was checked above
        assert stats.bytes <= start
    finally:
        store.close()


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EOPNOTSUPP])
def test_no_blocks_at_open_means_no_writemap(tmp_path, monkeypatch, err):
    monkeypatch.setattr(map_file, "reserve", lambda path, size: err)
    ns, store = _store(tmp_path / "s")
    try:
        assert store._shared.writemap is False
        assert store._env.flags()["writemap"] is False
        ok, got = _write_and_check(store, ns, MIB, 12)
        assert all(ok) and all(got)
    finally:
        store.close()


def test_unsupported_reservation_still_lets_the_map_grow(tmp_path, monkeypatch):
    real = map_file.reserve
    calls = []

    def unsupported_after_open(path, size):
        calls.append(size)
        return real(path, size) if len(calls) == 1 else errno.EOPNOTSUPP

    monkeypatch.setattr(map_file, "reserve", unsupported_after_open)
    ns, store = _store(tmp_path / "s")
    try:
        if not store._shared.writemap:
            pytest.skip("no fallocate here: the store runs without writemap")
        ok, got = _write_and_check(store, ns, MIB, 40)
        assert all(ok) and all(got) and store.stats().map_resizes >= 1 and len(calls) >= 2
    finally:
        store.close()


def _vm_flags(data: Path) -> list[set[str]]:
    """VmFlags of each of this process's mappings of ``data``."""
    ranges = {f"{lo:x}-{hi:x}" for lo, hi in map_file.mappings_of(data)}
    flags, current = [], None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                current = head in ranges
            elif head == "VmFlags:" and current:
                flags.append(set(line.split()[1:]))
    return flags


def test_hugepage_advice_reaches_every_mapping_and_survives_a_resize(tmp_path):
    ns, store = _store(tmp_path / "s", hugepages=True)
    try:
        data = tmp_path / "s" / "data.mdb"
        if not map_file.advise_hugepages(data):
            pytest.skip("MADV_HUGEPAGE is not available on this kernel")
        flags = _vm_flags(data)
        assert flags and all("hg" in f for f in flags)
        ok, got = _write_and_check(store, ns, MIB, 40)  # grows the map: a new mapping
        assert all(ok) and all(got) and store.stats().map_resizes >= 1
        flags = _vm_flags(data)
        assert flags and all("hg" in f for f in flags)
    finally:
        store.close()


def test_no_hugepage_advice_by_default(tmp_path):
    ns, store = _store(tmp_path / "s")
    try:
        flags = _vm_flags(tmp_path / "s" / "data.mdb")
        assert flags and not any("hg" in f for f in flags)
    finally:
        store.close()


def test_mappings_of_a_file_that_is_not_mapped_is_empty(tmp_path):
    f = tmp_path / "plain"
    f.write_bytes(np.random.default_rng(0).bytes(4096))
    assert map_file.mappings_of(f) == [] and map_file.mappings_of(tmp_path / "nope") == []


_FULL_DISK = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {root!r})
    from tests.storage.test_map_file import _store, _write_and_check
    ns, store = _store({path!r}, budget=256 << 20)
    ok, got = _write_and_check(store, ns, 1 << 20, 96)
    stats = store.stats()
    store.close()
    print("RESULT", sum(ok), sum(got), stats.errors.get("grow map: ENOSPC", 0), stats.pages)
    """
)


def test_a_full_disk_is_counted_not_a_crash(tmp_path):
    """A 40 MiB tmpfs under a store with a 256 MiB budget: writing 96 MiB must not kill the
    process (with writemap and no reservation, the first fault past the disk's end is a SIGBUS),
    the failed growth is counted, and what is stored reads back exactly."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mnt)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        root = str(Path(__file__).resolve().parents[2])
        script = _FULL_DISK.format(root=root, path=str(mnt / "store"))
        run = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, f"rc={run.returncode} stderr={run.stderr[-2000:]}"
        line = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT")][-1]
        set_ok, got, enospc, pages = (int(x) for x in line.split()[1:])
        # older pages are evicted to make room: sets succeed, only the newest stay
        assert enospc >= 1 and 0 < pages < 96 and 0 < got <= set_ok and got < 96
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
        os.sync()
