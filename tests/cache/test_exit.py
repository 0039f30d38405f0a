"""A process that serves through a cache with a host tier and exits without ``close()`` or
``drain()`` exits with its own status (it used to abort: a copy thread frozen inside torch at
interpreter exit)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys, tempfile, torch
from tiered_kv.cache import TieredKVCache
from tiered_kv.config import TieredKVConfig
storage = {storage}
cfg = TieredKVConfig.flat(num_layers=2, head_num=2, head_dim=8, page_size=4, device_tokens=64,
    host_tokens=128, storage_bytes=(64 << 20) if storage else 0,
    storage_path=tempfile.mkdtemp(dir="."), model_id="test-model@1")
cache = TieredKVCache(cfg)
for i in range(6):
    prompt = list(range(100 + i, 140 + i))
    req = cache.begin(prompt)
    slots = cache.extend(req, prompt[req.prefix_len:])
    for layer in range(2):
        k = torch.randn(len(slots), 2, 8)
        cache.write_kv(layer, slots, k, -k)
    cache.finish(req)
sys.exit({status})
"""


@pytest.mark.parametrize("storage", [False, True])
@pytest.mark.parametrize("status", [0, 3])
def test_exit_without_close_keeps_the_exit_status(tmp_path, storage, status):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(storage=storage, status=status)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == status, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr


# Registered before the cache exists, so it runs after the cache's own exit hooks (last
# registered, first run): by then no tiered-kv thread may still be running Python or torch code.
# (The abort itself is a race that a run hits ~3% of the time; the live threads are certain.)
THREADS_AT_EXIT = (
    """
import atexit, sys, threading
def report():
    alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("tiered-kv"))
    sys.stderr.write("ALIVE " + ",".join(alive) + "\\n")
atexit.register(report)
"""
    + SCRIPT
)


@pytest.mark.parametrize("storage", [False, True])
def test_no_tiered_kv_thread_outlives_the_exit_hooks(tmp_path, storage):
    proc = subprocess.run(
        [sys.executable, "-c", THREADS_AT_EXIT.format(storage=storage, status=0)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = [s for s in proc.stderr.splitlines() if s.startswith("ALIVE")]
    assert line == ["ALIVE "], proc.stderr[-2000:]
