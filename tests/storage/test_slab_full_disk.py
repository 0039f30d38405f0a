"""SlabStorage on a file system that another file fills (issue 38): sets keep storing by reusing
the store's own slots, what could not be stored is counted, every page served is exact, and the
store grows again once the other file is gone. On a real small tmpfs and a loop-mounted ext4
image (1 KiB blocks: LMDB's page writes can be cut short there), mounted for the test (root
only; skipped where the mount is impossible). The growing store filling the disk by itself is
``test_slab_processes.test_a_full_disk_is_a_counted_skip_never_a_crash``."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tiered_kv.storage.slab_store import SlabStorage

from ._util import ByteSource, byte_namespace, raw_key

NBYTES = 65536 + 520  # 17 blocks a slot, the last one mostly padding
BATCH = 16
SCENARIOS = {  # page bytes, pages per set
    "issue": (NBYTES, BATCH),
    # a set's index work overflows the index's reserve on the full disk: smaller transactions
    "large-sets": (5000, 256),
}
FS_MIB = {"tmpfs": 40, "ext4": 48}


def _mount(kind: str, where: Path) -> None:
    """Mount a small file system of ``kind`` at ``where`` or skip, naming why."""
    if kind == "tmpfs":
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={FS_MIB[kind]}m", "tmpfs", str(where)]
    else:
        if shutil.which("mkfs.ext4") is None:
            pytest.skip("mkfs.ext4 is not installed")
        image = where.parent / "ext4.img"
        with open(image, "wb") as f:
            f.truncate(FS_MIB[kind] << 20)
        made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True)
        if made.returncode != 0:
            pytest.skip(f"mkfs.ext4 failed: {made.stderr.decode().strip()}")
        cmd = ["mount", "-o", "loop", str(image), str(where)]
    mounted = subprocess.run(cmd, capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small {kind} here: {mounted.stderr.decode().strip()}")


@pytest.fixture(params=["tmpfs", "ext4"])
def small_fs(request, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    _mount(request.param, mnt)
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(mnt: Path) -> Path:
    """Another file takes every free block of the file system (writes down to 512 bytes)."""
    path = mnt / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for size in (1 << 20, 4096, 512):
            chunk = os.urandom(size)
            try:
                while True:
                    os.write(fd, chunk)
            except OSError:
                pass
    finally:
        os.close(fd)
    return path


class _Writer:
    """Sets batches of fresh random pages and remembers what each stored key holds."""

    def __init__(self, store: SlabStorage, seed: int, batch: int = BATCH) -> None:
        self.store, self.ns, self.size = store, store.namespace, batch
        self.nbytes = store.page_nbytes
        self.gen = torch.Generator().manual_seed(seed)
        self.src = ByteSource(self.nbytes, batch)
        self.stored: dict[bytes, np.ndarray] = {}
        self.count = 0

    def batch(self, n: int | None = None) -> list[bool]:
        n = n or self.size
        keys = [raw_key(self.ns, f"page-{self.count + i}") for i in range(n)]
        self.count += n
        shape = (n, self.nbytes)
        self.src.buf[:n] = torch.randint(0, 256, shape, generator=self.gen, dtype=torch.uint8)
        ok = self.store.batch_set(keys, self.src, list(range(n)))
        for i, (key, stored) in enumerate(zip(keys, ok, strict=True)):
            if stored:
                self.stored[key] = self.src.buf[i].numpy().copy()
        return ok

    def check(self) -> int:
        """Read every key ever stored: each one served is byte-exact. Returns how many were."""
        out, served = ByteSource(self.nbytes, self.size), 0
        keys = list(self.stored)
        for start in range(0, len(keys), self.size):
            part = keys[start : start + self.size]
            got = self.store.batch_get(part, out, list(range(len(part))))
            for i, key in enumerate(part):
                if got[i]:
                    served += 1
                    assert np.array_equal(out.buf[i].numpy(), self.stored[key]), key.hex()
        return served


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_disk_filled_by_another_file_keeps_storing_by_reusing_slots(small_fs, scenario):
    """The issue's script: 4 sets stored, another file fills the disk, 20 more sets: at least
    80% stored (lmdb layout: 100%), the rest counted as skipped, evictions made the room, every
    page still there exact; the other file removed, 8 more sets grow the store."""
    nbytes, batch = SCENARIOS[scenario]
    store = SlabStorage(small_fs / "store", byte_namespace(nbytes), nbytes, budget_bytes=256 << 20)
    try:
        w = _Writer(store, seed=38, batch=batch)
        first = [w.batch() for _ in range(4)]
        assert sum(map(sum, first)) == 4 * batch
        filler = _fill(small_fs)
        assert os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize < nbytes

        later = [w.batch() for _ in range(20)]
        stored = sum(map(sum, later))
        served = w.check()  # every page left is exact...
        s = store.stats()
        assert stored >= 0.8 * 20 * batch, (stored, s)
        assert s.set_skipped == 24 * batch - sum(map(sum, first + later)), s  # counted
        assert s.evictions > 0 and s.errors.get("grow slab: ENOSPC", 0) > 0, s
        assert served == s.pages >= batch and all(later[-1]), (served, s)  # ...the newest there

        filler.unlink()  # room again: the store grows instead of evicting
        grown = [w.batch() for _ in range(8)]
        after = store.stats()
        assert all(map(all, grown)), grown
        assert after.evictions == s.evictions and after.pages == s.pages + 8 * batch, after
        assert after.errors == s.errors, after.errors
        assert w.check() == after.pages
    finally:
        store.close()


def test_a_free_slot_without_blocks_becomes_a_hole_not_a_stuck_set(small_fs):
    """A transaction that gave a free slot's blocks back and then aborted leaves a slot the
    index calls free with blocks, that has none. On a full disk its write fails: the slot
    becomes a hole (counted) and later sets evict and store, instead of failing on it for ever."""
    store = SlabStorage(small_fs / "store", byte_namespace(NBYTES), NBYTES, budget_bytes=256 << 20)
    try:
        w = _Writer(store, seed=7)
        assert all(w.batch(8))
        gone = list(w.stored)[:4]
        books = store._books
        slots = store._read(lambda txn: [books.lookup(txn, k).slot for k in gone])
        assert store.delete(gone) == 4
        for key in gone:
            del w.stored[key]
        for slot in slots:  # behind the index's back: what the aborted transaction did
            assert store._files.slab.release(slot) == 0
        _fill(small_fs)
        batches = [w.batch(4) for _ in range(4)]
        s = store.stats()
        assert s.errors.get("write slab: ENOSPC", 0) >= 1, s.errors
        assert all(map(all, batches[1:])), batches
        assert w.check() == s.pages
    finally:
        store.close()
