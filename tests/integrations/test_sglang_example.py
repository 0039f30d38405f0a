"""The README's CPU SGLang example (``examples/sglang_hicache_cpu.py``) runs: in ``.venv-sglang``
SGLang's controller backs pages up through tiered_kv and restores them bit for bit after a
restart; without SGLang it says how to get it and exits 3."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations.sglang_stack import sglang_missing

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sglang_hicache_cpu.py"


def run_example(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(sglang_missing() is not None, reason=str(sglang_missing()))
def test_the_example_restores_pages_through_sglangs_controller(tmp_path):
    done = run_example("--pages", "5", "--store", str(tmp_path / "store"), "--seed", "7")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "loaded TieredKVHiCacheStorage" in done.stdout
    assert "prefetched 80 tokens (5 page hits, 0 misses)" in done.stdout
    assert "bit for bit" in done.stdout


@pytest.mark.skipif(sglang_missing() is None, reason="SGLang is installed: not this test")
def test_without_sglang_the_example_says_so_and_exits_3():
    done = run_example()
    assert done.returncode == 3
    assert "make sglang-venv" in done.stdout
