"""The README works for a newcomer: each Python block runs alone in a fresh interpreter (its own
imports and setup), the `tiered-kv sim --trace` command runs on the trace shipped in the
repository, and no path points outside the repository."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GPU_MARK = "<!-- gpu -->"  # a block right after this comment needs a GPU
MIN_BLOCKS = 9  # the README has this many CPU blocks at least: losing one fails here


def python_blocks() -> list[tuple[int, str, bool]]:
    """(line of the opening fence, code, needs a GPU) for each ```python block."""
    text = README.read_text()
    out = []
    for m in re.finditer(r"```python\n(.*?)```", text, flags=re.S):
        before = text[: m.start()].rstrip()
        line = text.count("\n", 0, m.start()) + 1
        out.append((line, m.group(1), before.endswith(GPU_MARK)))
    return out


BLOCKS = python_blocks()


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


def test_the_readme_has_its_cpu_blocks():
    assert sum(not gpu for _, _, gpu in BLOCKS) >= MIN_BLOCKS


@pytest.mark.parametrize(("line", "code", "gpu"), BLOCKS, ids=[f"line{b[0]}" for b in BLOCKS])
def test_each_python_block_runs_alone(line, code, gpu, tmp_path):
    if gpu and not gpu_available():
        pytest.skip(f"the block at README.md:{line} is marked {GPU_MARK}")
    # A fresh interpreter in an empty directory: nothing from another block, nothing left behind.
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"README.md:{line} failed:\n{done.stderr[-3000:]}"


def sim_trace_command() -> list[str]:
    """The README's `tiered-kv sim --trace ...` line, as arguments after `tiered-kv`."""
    lines = [
        line.split("#")[0].strip()
        for line in README.read_text().splitlines()
        if line.startswith("tiered-kv sim --trace ")
    ]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])[1:]


def test_the_readme_sim_command_runs_on_the_shipped_trace(tmp_path):
    args = sim_trace_command()
    trace = Path(args[args.index("--trace") + 1])
    assert not trace.is_absolute() and (ROOT / trace).is_file(), trace
    if "--plot" in args:  # the plot goes to the test's directory, not the checkout
        args[args.index("--plot") + 1] = str(tmp_path / "hit.png")
    quick = ["--max-requests", "300", "--capacities", "0.1", "--policies", "lru", "--jobs", "1"]
    out = tmp_path / "sim.json"
    done = subprocess.run(
        [sys.executable, "-m", "tiered_kv.cli.main", *args, *quick, "--no-progress"]
        + ["--json", str(out)],
        cwd=ROOT,  # the README's commands run from the repository's root
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["requests"] == 300 and result["rows"][0]["hit_rate"] > 0
    if "--plot" in args:
        assert (tmp_path / "hit.png").stat().st_size > 0


def test_no_path_points_outside_the_repository():
    docs = [README, *sorted((ROOT / "docs").glob("*.md"))]
    outside = re.compile(r"\.\./shared|/work/|/tmp/peer")
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in docs
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if outside.search(line)
    ]
    assert found == []
