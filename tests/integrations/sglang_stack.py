"""SGLang 0.5.23's HiCache stack in this process, or why not (a sentence).

On a CPU-only machine SGLang's module chain needs the stand-ins in ``tools/sglang_peer/stubs``
(two unrelated imports, and the host pools' copy ops); they are put on ``sys.path`` only when
SGLang itself is installed and torch has no CUDA, so nothing else ever sees them. ``make test``
runs these tests in ``.venv-sglang`` (``make sglang-venv``); elsewhere they skip."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from pathlib import Path

import torch

STUBS = Path(__file__).resolve().parents[2] / "tools" / "sglang_peer" / "stubs"
OUR_BACKEND = ("tiered_kv.integrations.sglang_hicache", "TieredKVHiCacheStorage")


@functools.cache
def sglang_missing() -> str | None:
    """None when SGLang's controller imports (stand-ins installed on CPU), else why not."""
    if importlib.util.find_spec("sglang") is None:
        return "SGLang is not installed here (make sglang-venv builds .venv-sglang)"
    if not torch.cuda.is_available() and str(STUBS) not in sys.path:
        sys.path.insert(0, str(STUBS))
    try:
        importlib.import_module("sglang.srt.managers.cache_controller")
        if not torch.cuda.is_available():
            importlib.import_module("peer_kvcacheio_cpu").install()
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to skip
        return f"SGLang's HiCache stack does not import here: {exc!r}"
    return None
