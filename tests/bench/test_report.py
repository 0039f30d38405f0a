"""Tables and JSON: fixed columns print exactly, JSON always carries config and machine."""

from __future__ import annotations

import argparse
import enum
import json
import math
from dataclasses import dataclass
from typing import NamedTuple

import pytest

from tiered_kv.bench import report
from tiered_kv.errors import InvalidArgumentError

C = report.Column


def test_fixed_table_pads_aligns_formats_and_rules():
    cols = [C("name", 6, left=True), C("n", 3), C("GB/s", 6, ".2f"), C("", 1, sep=""), C("x", 2)]
    lines = report.fixed_table(cols, [["ab", 7, 1.234, "*", None], ["abcdefg", 12, 10.0, " ", 3]])
    assert lines == [
        "name     n   GB/s   x",
        "---------------------",
        "ab       7   1.23*  -",
        "abcdefg  12  10.00   3",
    ]
    with pytest.raises(InvalidArgumentError, match="2 values for 5 columns"):
        report.fixed_table(cols, [["a", 1]])


def test_auto_table_widths_come_from_the_cells():
    text = report.auto_table(["layout", "GB/s"], [["page_first", 12.345], ["x", 0.5]])
    assert text.splitlines() == [
        "layout       GB/s",
        "----------  -----",
        "page_first  12.35",
        "x             0.5",
    ]


class Kind(enum.Enum):
    A = "a"


class Pair(NamedTuple):
    x: int
    y: float


@dataclass
class Rowish:
    name: str
    pair: Pair
    kind: Kind


def test_to_jsonable_handles_dataclasses_namedtuples_enums_and_non_finite_floats():
    data = report.to_jsonable({"r": Rowish("n", Pair(1, math.inf), Kind.A), "t": (1, 2)})
    assert data == {"r": {"name": "n", "pair": {"x": 1, "y": "inf"}, "kind": "a"}, "t": [1, 2]}


def test_write_json_records_config_and_machine(tmp_path):
    args = argparse.Namespace(repeats=3, sizes=[0.5, 2.0], json=str(tmp_path / "o.json"))
    path = tmp_path / "sub" / "o.json"
    report.write_json(
        path, {"rows": [{"a": 1}]}, config=report.config_of(args), machine={"cpu_count": 2}
    )
    data = json.loads(path.read_text())
    assert data == {
        "rows": [{"a": 1}],
        "config": {"repeats": 3, "sizes": [0.5, 2.0]},  # the output path is not a setting
        "machine": {"cpu_count": 2},
    }
    with pytest.raises(InvalidArgumentError, match="machine"):
        report.write_json(path, {"machine": 1}, config={}, machine={})
    report.dump_json(None, {"never": "written"})  # no path: nothing happens
