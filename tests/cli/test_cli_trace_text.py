"""Issue 38: ``tiered-kv sim --trace`` on a file that is not UTF-8 text (a binary file, a
gzip-compressed trace, a bad byte deep in a good one) exits 2 with one line naming ``--trace``,
the file and what is wrong, never a ``UnicodeDecodeError`` traceback. Real processes."""

from __future__ import annotations

import gzip
import json

from tests.cli.cli_process import assert_refused, tiered_kv

SIM = ["sim", "--no-progress", "--jobs", "1", "--capacities", "0.5", "--policies", "lru"]
MOONCAKE = json.dumps({"timestamp": 0, "input_length": 32, "output_length": 4, "hash_ids": [1, 2]})


def test_sim_trace_that_is_not_text_exits_2_naming_the_flag(tmp_path):
    binary = tmp_path / "trace.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    line = assert_refused(tiered_kv(*SIM, "--trace", str(binary)), f"--trace {binary}", "UTF-8")
    assert "byte 0x80 at offset 128" in line, line  # the first byte that is not UTF-8
    packed = tmp_path / "trace.jsonl.gz"
    packed.write_bytes(gzip.compress((MOONCAKE + "\n").encode()))
    assert_refused(tiered_kv(*SIM, "--trace", str(packed)), f"--trace {packed}", "gzip")


def test_sim_trace_with_a_bad_byte_deep_inside_exits_2_naming_its_line(tmp_path):
    """Past the check made before any work: the reader's own error, one line naming the line."""
    for fmt, first in (("mooncake", MOONCAKE), ("bailian", None)):
        trace = tmp_path / f"{fmt}.jsonl"
        lines = [first or _bailian(n) for n in range(5000)]  # ~0.3 MB of good lines first
        trace.write_bytes("\n".join(lines).encode() + b'\n{"chat_id": \xff}\n')
        done = tiered_kv(*SIM, "--trace", str(trace), "--trace-format", "auto")
        assert_refused(done, f"--trace {trace}", f"{trace}:5001", "UTF-8")


def _bailian(n: int) -> str:
    return json.dumps(
        {"chat_id": n, "parent_chat_id": -1, "timestamp": n, "input_length": 32,
         "output_length": 4, "type": "text", "turn": 1, "hash_ids": [n, n + 1]}
    )  # fmt: skip
