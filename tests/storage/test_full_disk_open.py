"""Opening a store, or building a cache with a storage tier, on a full file system is a typed
``StorageOpenError`` (or a store that works), never a signal: LMDB maps its lock file and a
sparse one on a full disk was a SIGBUS inside ``lmdb.open`` (issue 12). The cache opens the
default ``storage_layout``, the store case the lmdb one. Runs in subprocesses, on a small tmpfs
filled up (root only; skipped where a tmpfs cannot be mounted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OPEN = """
import sys
sys.path.insert(0, {root!r})
from tiered_kv.errors import StorageOpenError
try:
    if {cache}:
        from tiered_kv.cache import TieredKVCache
        from tiered_kv.config import TieredKVConfig
        cfg = TieredKVConfig.flat(num_layers=2, head_num=2, head_dim=8, page_size=4,
            device_tokens=64, host_tokens=64, storage_bytes=64 << 20, storage_path={path!r},
            model_id="test-model@1")
        TieredKVCache(cfg).close()
    else:
        from tiered_kv.storage import LMDBStorage, StorageNamespace
        ns = StorageNamespace.create(model="m", kind="bytes", parts=[("raw", [4096])],
            dtype="uint8", layer_ids=[0], page_size=1, layout="page_first")
        LMDBStorage({path!r}, ns, 4096, budget_bytes=64 << 20).close()
    print("opened")
except StorageOpenError as exc:
    print("refused", exc)
"""


@pytest.fixture
def full_tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def _fill(mnt: Path, leave_kib: int) -> None:
    (mnt / "fill").unlink(missing_ok=True)
    free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
    with open(mnt / "fill", "wb") as f:
        f.write(b"\1" * max(0, free - leave_kib * 1024))


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("leave_kib", [0, 92, 400])
def test_open_on_a_full_disk_is_typed_never_a_signal(full_tmpfs, cache, leave_kib):
    _fill(full_tmpfs, leave_kib)
    code = OPEN.format(root=str(ROOT), cache=cache, path=str(full_tmpfs / "store"))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, f"rc {proc.returncode} (-7/135: SIGBUS)\n{proc.stderr[-1500:]}"
    out = proc.stdout.strip()
    refused = ("refused cannot open LMDB store", "refused cannot open slab store")
    assert out == "opened" or out.startswith(refused), out
    if leave_kib == 0:
        assert out.startswith("refused"), out
