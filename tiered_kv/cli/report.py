"""Plain-text tables and JSON output for the command line (tables: the measuring library's)."""

from __future__ import annotations

import json
from pathlib import Path

from tiered_kv.bench.report import auto_table as table

__all__ = ["table", "write_json"]


def write_json(path: str | None, data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")
