"""Plain-text tables and JSON output for the command line (tables: the measuring library's)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tiered_kv.bench.report import auto_table as table

__all__ = ["table", "write_json"]


def write_json(path: str | None, data: dict) -> None:
    """``data`` as JSON in ``path`` (None: nothing), whole or not at all: written beside it,
    then renamed over it, so a failure (a full disk, Ctrl-C) leaves the old file or none. The
    commands check ``path`` before any work (``preflight.check_output_file``); other callers
    (the benchmarks) get its folder created."""
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=2, default=str) + "\n"
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        partial.write_text(text)
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
