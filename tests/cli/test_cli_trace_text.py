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


def test_sim_capacities_beyond_the_trace_are_capped_not_a_crash(tmp_path):
    """A block count or host ratio far beyond the trace (1e18 blocks, ratio 1.7e308) used to end
    in MemoryError / OverflowError in the tier's free list: a tier holding every unique block
    never evicts, so it is capped there and the run reports what it used."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(_bailian(n) for n in range(40)) + "\n")
    out = tmp_path / "sim.json"
    args = ["sim", "--no-progress", "--jobs", "1", "--policies", "lru", "--trace", str(trace)]
    done = tiered_kv(
        *args, "--capacities", "1e18", "--host-ratio", "1.7e308", "--storage", "1e17",
        "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    report = json.loads(out.read_text())
    unique = report["unique_blocks"]
    row = report["rows"][0]
    assert row["device_blocks"] == unique and row["host_blocks"] == unique, row
