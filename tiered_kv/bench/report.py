"""Text tables and JSON results.

Two tables: ``fixed_table`` (declared columns of fixed width, the scripts' tables, whose
headers the docs quote) and ``auto_table`` (widths from the cells, the command's tables).
``write_json`` always records the run's config and the machine's details next to the payload,
so a figure can be traced back to how and where it was measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from tiered_kv.errors import InvalidArgumentError


class Column(NamedTuple):
    """One column of a fixed table: title, width, format spec of its values, left-aligned or
    not, and the separator written before it (ignored for the first column)."""

    title: str
    width: int
    spec: str = ""
    left: bool = False
    sep: str = " "


def _cell(value: object, col: Column) -> str:
    text = "-" if value is None else format(value, col.spec)
    return text.ljust(col.width) if col.left else text.rjust(col.width)


def _join(cells: Sequence[str], columns: Sequence[Column]) -> str:
    out = cells[0]
    for text, col in zip(cells[1:], columns[1:], strict=True):
        out += col.sep + text
    return out


def fixed_table(columns: Sequence[Column], rows: Sequence[Sequence[object]]) -> list[str]:
    """Header, a rule of ``-`` as long as the header, and one line per row (None prints
    ``-``). Each row has one value per column."""
    header = _join([_cell(c.title, c._replace(spec="")) for c in columns], columns)
    lines = [header, "-" * len(header)]
    for row in rows:
        if len(row) != len(columns):
            raise InvalidArgumentError(f"a row has {len(row)} values for {len(columns)} columns")
        lines.append(_join([_cell(v, c) for v, c in zip(row, columns, strict=True)], columns))
    return lines


def format_value(value: object) -> str:
    """A float with about three significant digits (no exponent above 1), anything else str."""
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def auto_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A right-aligned text table (first column left-aligned), widths from the cells."""
    cells = [[format_value(c) for c in row] for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.ljust(w) if i == 0 else v.rjust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


# -- JSON -----------------------------------------------------------------------------------
def to_jsonable(value: Any) -> Any:
    """Plain JSON data: dataclasses and NamedTuples as dicts, tuples and sets as lists, enums
    as their values, non-finite floats as strings, anything else unknown as ``str``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(dataclasses.asdict(value))
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return to_jsonable(value._asdict())
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, enum.Enum):
        return to_jsonable(value.value)
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # numpy / torch scalars
        return to_jsonable(value.item())
    return str(value)


def config_of(args: argparse.Namespace | Mapping[str, Any]) -> dict[str, Any]:
    """A run's settings (parsed arguments, minus the output path) as JSON data."""
    items = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    return {k: to_jsonable(v) for k, v in items.items() if k != "json" and not callable(v)}


def dump_json(path: str | Path | None, data: Any) -> None:
    """Write ``data`` as indented JSON (parent folders created); nothing without a path."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(to_jsonable(data), indent=2) + "\n")


def with_context(
    payload: Mapping[str, Any], *, config: Mapping[str, Any], machine: Mapping[str, Any]
) -> dict[str, Any]:
    """``payload`` with ``config`` and ``machine`` keys added (they must not be in it)."""
    clash = {"config", "machine"} & set(payload)
    if clash:
        raise InvalidArgumentError(f"the payload already has {sorted(clash)}: rename them")
    return {**payload, "config": dict(config), "machine": dict(machine)}


def write_json(
    path: str | Path | None,
    payload: Mapping[str, Any],
    *,
    config: Mapping[str, Any],
    machine: Mapping[str, Any],
) -> None:
    """Write a result with its config and machine details (see ``with_context``)."""
    dump_json(path, with_context(payload, config=config, machine=machine))
