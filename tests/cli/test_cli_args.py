"""``tiered-kv`` argument checking: a bad value exits 2 naming the flag and the value; ``--help``
of every subcommand exits 0 and shows each option's default; the console script runs."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiered_kv.cli import run_cmd
from tiered_kv.cli.main import build_parser, main


@pytest.fixture(autouse=True)
def _no_default_store(monkeypatch, tmp_path):
    """Never touch the default ~/.cache store, even if a check stops failing and
    `run-reference` runs."""
    monkeypatch.setattr(run_cmd, "default_cache_dir", lambda: tmp_path / "cache")


def _fail(capsys, argv: list[str]) -> str:
    """Run the CLI in-process; it must exit 2. Returns stderr."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, (argv, info.value.code, err)
    assert "Traceback" not in err
    return err


# (argv, substrings stderr must contain: the flag and the bad value)
RUN_ERRORS = [
    (["--users", "abc"], ["--users", "'abc'", "not an integer"]),
    (["--users", "0"], ["--users", "0 must be >= 1"]),
    (["--scale", "0"], ["--scale", "0.0 must be in (0, 10000)"]),
    (["--scale", "x"], ["--scale", "'x'", "not a number"]),
    (["--preset", "gpt-9"], ["--preset", "'gpt-9'", "llama-3-8b"]),
    (["--cost-model", "tpu"], ["--cost-model", "'tpu'"]),
    (["--pcie-gbps", "-1"], ["--pcie-gbps", "-1.0 must be > 0"]),
    (["--chunk-tokens", "100", "--page-size", "64"], ["chunk_tokens=100"]),
]

REFERENCE_ERRORS = [
    (["--storage-backend", "s3"], ["--storage-backend 's3'", "module.path:ClassName"]),
    (["--storage-options", "{url"], ["--storage-options", "not JSON"]),
    (["--storage-options", "[1, 2]"], ["--storage-options", "not a JSON object"]),
    (["--users", "abc"], ["--users", "'abc'", "not an integer"]),
    (["--users", "0"], ["--users", "0 must be >= 1"]),
    (["--rounds", "-2"], ["--rounds", "-2 must be >= 1"]),
    (["--layers", "1.5"], ["--layers", "'1.5'", "not an integer"]),
    (["--answer-tokens", "-1"], ["--answer-tokens", "-1 must be >= 0"]),
    (["--prefetch-threshold", "x"], ["--prefetch-threshold", "'x'"]),
    (["--storage-mib", "0"], ["--storage-mib", "0 must be >= 1"]),
    (["--seed", "s"], ["--seed", "'s'"]),
    (["--page-size", "12"], ["--page-size 12", "power of two"]),
    (["--page-size", "8", "--device-tokens", "100"], ["--device-tokens 100", "--page-size 8"]),
    (["--page-size", "8", "--host-tokens", "8"], ["--host-tokens 8", "two pages"]),
    (["--heads", "3", "--kv-heads", "2"], ["--heads 3", "multiple of --kv-heads 2"]),
    (["--head-dim", "15"], ["--head-dim 15", "even"]),
    (["--head-dim", "18", "--attention", "mla"], ["--head-dim 18", "multiple of 4"]),
    (["--attention", "mha"], ["--attention", "mha"]),
    (
        ["--system-tokens", "200", "--page-size", "16", "--device-tokens", "128"],
        ["--device-tokens", "128"],
    ),
    (["--device-policy", "bogus"], ["--device-policy", "'bogus'", "lru"]),
    (["--host-policy", "mru"], ["--host-policy", "'mru'"]),
    (["--write-policy", "never"], ["--write-policy", "'never'", "write_through"]),
    (["--prefetch-policy", "eager"], ["--prefetch-policy", "'eager'", "best_effort"]),
    (["--host-layout", "rows"], ["--host-layout", "'rows'", "page_first"]),
    (["--storage-layout", "files"], ["--storage-layout", "'files'", "lmdb", "slab"]),
]

SIM_ERRORS = [
    (["--capacities", "0"], ["--capacities", "'0'"]),
    (["--capacities", "-1"], ["--capacities", "'-1'"]),
    (["--capacities", "1.5"], ["--capacities", "'1.5'"]),
    (["--capacities", "x"], ["--capacities", "'x'", "not a number"]),
    (["--capacities", "0.5,0"], ["--capacities", "'0'"]),
    (["--capacities", ","], ["--capacities", "no capacities"]),
    (["--plot", "hit.jpg"], ["--plot hit.jpg", ".png"]),
    (["--plot", "/nonexistent-dir/hit.png"], ["--plot /nonexistent-dir/hit.png", "cannot write"]),
    (["--jobs", "0"], ["--jobs", "0 must be >= 1"]),
    (["--generator", "chat"], ["--generator", "conversation"]),
    (["--storage", "0.5", "--host-ratio", "0"], ["--storage", "--host-ratio"]),
    (["--storage", "-1"], ["--storage -1"]),
    (["--storage", "2.5"], ["--storage 2.5"]),
    (["--storage", "y"], ["--storage", "'y'"]),
    (["--host-ratio", "-1"], ["--host-ratio", "-1.0 must be >= 0"]),
    (["--host-ratio", "x"], ["--host-ratio", "'x'"]),
    (["--policies", "lru,bogus"], ["--policies", "bogus", "lru, lfu"]),
    (["--policies", ","], ["--policies", "nothing"]),
    (["--write-policy", "nope"], ["--write-policy", "'nope'"]),
    (["--generator", "chat"], ["--generator", "'chat'", "multi-round"]),
    (["--repeat", "twice"], ["--repeat", "'twice'"]),
    (["--block-size", "0"], ["--block-size", "0 must be >= 1"]),
    (["--users", "x"], ["--users", "'x'"]),
    (["--max-requests", "-1"], ["--max-requests", "-1 must be >= 0"]),
    (["--history", "-5"], ["--history", "-5 must be >= 0"]),
]

BENCH_ERRORS = [
    (["--page-sizes", "8,12"], ["--page-sizes", "'8,12'", "[12]"]),
    (["--page-sizes", "0"], ["--page-sizes", "'0'", "[0]"]),
    (["--page-sizes", "a,b"], ["--page-sizes", "'a,b'", "integers"]),
    (["--page-sizes", ","], ["--page-sizes", "powers of two"]),
    (["--tokens", "100", "--page-sizes", "16"], ["--tokens 100", "[16]"]),
    (["--tokens", "64", "--page-sizes", "8,128"], ["--tokens 64", "[8, 128]"]),
    (["--tokens", "0"], ["--tokens", "0 must be >= 1"]),
    (["--layers", "-1"], ["--layers", "-1 must be >= 1"]),
    (["--repeats", "two"], ["--repeats", "'two'"]),
    (["--layouts", "nope"], ["--layouts", "nope", "page_first"]),
    (["--io-backends", "dma"], ["--io-backends", "dma", "kernel"]),
    (["--dtype", "int8"], ["--dtype", "'int8'", "float16"]),
    (["--device", "tpu"], ["--device", "'tpu'", "cuda"]),
]


@pytest.mark.parametrize(("argv", "expected"), RUN_ERRORS, ids=lambda v: " ".join(v))
def test_run_bad_values_exit_2_naming_the_flag(capsys, tmp_path, argv, expected):
    err = _fail(capsys, ["run", "--store-dir", str(tmp_path), *argv])
    assert "tiered-kv run: error:" in err
    for text in expected:
        assert text in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("argv", "expected"), REFERENCE_ERRORS, ids=lambda v: " ".join(v))
def test_run_reference_bad_values_exit_2_naming_the_flag(capsys, tmp_path, argv, expected):
    # --store keeps the default ~/.cache store untouched should a check ever stop failing.
    err = _fail(capsys, ["run-reference", "--no-progress", "--store", str(tmp_path / "s"), *argv])
    assert "tiered-kv run-reference: error:" in err
    for text in expected:
        assert text in err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(("argv", "expected"), SIM_ERRORS, ids=lambda v: " ".join(v))
def test_sim_bad_values_exit_2_naming_the_flag(capsys, argv, expected):
    err = _fail(capsys, ["sim", "--no-progress", *argv])
    assert "tiered-kv sim: error:" in err
    for text in expected:
        assert text in err


@pytest.mark.parametrize(("argv", "expected"), BENCH_ERRORS, ids=lambda v: " ".join(v))
def test_bench_bad_values_exit_2_naming_the_flag(capsys, argv, expected):
    err = _fail(capsys, ["bench", "--no-progress", *argv])
    assert "tiered-kv bench: error:" in err
    for text in expected:
        assert text in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="only meaningful without CUDA")
def test_bench_cuda_without_cuda_is_an_argument_error(capsys):
    err = _fail(capsys, ["bench", "--no-progress", "--device", "cuda"])
    assert "--device cuda" in err


def test_no_or_unknown_subcommand(capsys):
    assert "required" in _fail(capsys, [])
    err = _fail(capsys, ["serve"])
    assert "'serve'" in err and "run" in err
    err = _fail(capsys, ["serve-scale"])  # renamed `run`, with no alias
    assert "'serve-scale'" in err and "'run', 'run-reference'" in err


def test_sim_missing_trace_is_a_clean_error(capsys, tmp_path):
    missing = tmp_path / "nope.jsonl"
    err = _fail(capsys, ["sim", "--no-progress", "--trace", str(missing)])
    assert f"--trace {missing}" in err
    assert "No such file" in err
    err = _fail(capsys, ["sim", "--no-progress", "--trace", str(tmp_path)])  # a directory
    assert f"--trace {tmp_path}" in err


def test_sim_malformed_trace_is_a_clean_error_naming_the_line(capsys, tmp_path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "hash_ids": [1, 2]}\n{"hash_ids": "x"}\n')
    err = _fail(capsys, ["sim", "--no-progress", "--trace", str(trace)])
    assert f"--trace {trace}" in err
    assert f"{trace}:2" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    err = _fail(capsys, ["sim", "--no-progress", "--trace", str(empty)])
    assert "no requests" in err


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _help_entries(text: str) -> dict[str, str]:
    """Option string -> its help entry (the option line and its continuation lines)."""
    entries: dict[str, str] = {}
    current: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if line.startswith("  -"):
            current = [stripped]
            for opt in re.split(r"\s{2,}", stripped)[0].replace(",", " ").split():
                if opt.startswith("-"):
                    entries[opt] = current  # type: ignore[assignment]
        elif line.startswith("   ") and current:
            current.append(stripped)
        else:
            current = []
    return {k: " ".join(v) for k, v in entries.items()}


@pytest.mark.parametrize("command", ["run", "run-reference", "sim", "bench"])
def test_help_exits_0_and_shows_every_default(capsys, monkeypatch, command):
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping: one entry per option
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: tiered-kv {command}")
    entries = _help_entries(out)
    checked = 0
    for action in _subparser(command)._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        entry = entries[action.option_strings[0]]
        assert f"(default: {action.default})" in entry, entry
        checked += 1
    assert checked >= 10
    assert out.count("(default: ") == checked


def test_help_shows_specific_defaults(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    entries = _help_entries(capsys.readouterr().out)
    assert "(default: llama-3-8b)" in entries["--preset"]
    assert "(default: 32)" in entries["--users"]
    with pytest.raises(SystemExit):
        main(["run-reference", "--help"])
    entries = _help_entries(capsys.readouterr().out)
    assert "(default: 1024)" in entries["--device-tokens"]
    assert "(default: lru)" in entries["--device-policy"]
    assert "(default: False)" in entries["--fresh"]
    with pytest.raises(SystemExit):
        main(["sim", "--help"])
    entries = _help_entries(capsys.readouterr().out)
    assert "(default: 0.05,0.1,0.25,0.5)" in entries["--capacities"]
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    entries = _help_entries(capsys.readouterr().out)
    assert "(default: 16,64)" in entries["--page-sizes"]


def test_console_script_entry_point(tmp_path):
    """The installed ``tiered-kv`` script (else ``python -m``) runs in a fresh process."""
    script = Path(sys.executable).with_name("tiered-kv")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "tiered_kv.cli.main"]
    done = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: tiered-kv")
    for command in ("run", "run-reference", "sim", "bench"):
        assert command in done.stdout
    assert "serve-scale" not in done.stdout
    # An argument error in a real process: status 2, one message, no traceback.
    done = subprocess.run(
        [*cmd, "sim", "--trace", str(tmp_path / "missing.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--trace" in done.stderr and "Traceback" not in done.stderr


def test_run_on_a_store_of_the_other_layout_exits_with_one_line(tmp_path, capsys):
    from tiered_kv.storage import LMDBStorage
    from tiered_kv.storage.keys import StorageNamespace

    ns = StorageNamespace.create(
        model="m", kind="bytes", parts=[("raw", [4096])], dtype="uint8", layer_ids=[0],
        page_size=1, layout="page_first",
    )  # fmt: skip
    store = tmp_path / "store"
    LMDBStorage(store, ns, 4096, budget_bytes=64 << 20).close()
    with pytest.raises(SystemExit) as info:
        main(["run-reference", "--store", str(store), "--storage-layout", "slab", "--no-progress"])
    text = str(info.value.code)
    assert "holds a store of the lmdb layout" in text and "--storage-layout" in text


def test_run_serves_the_hybrid_presets_at_their_own_scale(capsys, monkeypatch):
    """``run --preset`` lists the sliding-window and hybrid presets; ``--scale`` left out is
    the preset's own (documented in the help), given it wins."""
    from tiered_kv.cli import scale_cmd

    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    entries = _help_entries(capsys.readouterr().out)
    for name in ("gemma-3-12b", "qwen3-next-80b-a3b", "deepseek-v3.2"):
        assert name in entries["--preset"]
    assert "gemma-3-4b 2, qwen3-next-80b-a3b 4" in entries["--scale"]
    parser = build_parser()
    for argv, scale in (
        (["--preset", "gemma-3-4b"], 2.0),
        (["--preset", "gemma-3-12b"], 1.0),
        (["--preset", "qwen3-next-80b-a3b"], 4.0),
        (["--preset", "deepseek-v3.2"], 4.0),
        (["--preset", "gemma-3-4b", "--scale", "1"], 1.0),
        ([], 1.0),
    ):
        assert scale_cmd.config_of(parser.parse_args(["run", *argv])).scale == scale
