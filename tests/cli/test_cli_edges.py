"""Issue 30: every path, port and size is checked before any work. A bad one exits 2 with one
line naming the flag and the value, no traceback, and nothing created or half-written. Each
case runs the real command in its own process. (Ctrl-C: test_cli_interrupt.py; remote stores
and the summary's storage lines: test_cli_store_status.py; --help without torch:
test_cli_help_fast.py.)"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path

import pytest

from tests.cli.cli_process import TINY_RUN, assert_refused, spawn, tiered_kv
from tiered_kv.cli import report

# Each command's smallest arguments (never reached: the checks refuse first).
SMALL = {
    "run": TINY_RUN,
    "run-reference": ["--no-progress", "--users", "1", "--rounds", "1"],
    "sim": ["--no-progress", "--users", "2", "--rounds", "1"],
    "bench": ["--no-progress", "--tokens", "64", "--layers", "1", "--repeats", "1"],
}


def _entries(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


# -- --json -------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", list(SMALL))
def test_json_naming_a_directory_is_refused_before_the_run(tmp_path, command):
    store = ["--store", str(tmp_path / "store")] if command == "run-reference" else []
    done = tiered_kv(command, *SMALL[command], *store, "--json", str(tmp_path))
    assert_refused(done, "--json", str(tmp_path), "is a directory")
    assert done.stdout == ""  # refused before the run printed anything
    assert _entries(tmp_path) == []  # no store either


def test_json_in_a_missing_directory_creates_nothing(tmp_path):
    target = tmp_path / "missing" / "deeper" / "out.json"
    done = tiered_kv("run", *TINY_RUN, "--json", str(target))
    assert_refused(done, "--json", str(target), "not a directory")
    assert _entries(tmp_path) == []


def test_write_json_leaves_the_old_file_or_none(tmp_path, monkeypatch):
    """A write that fails half-way (a full disk) leaves the previous file as it was and no
    partial file beside it; a write that succeeds replaces it whole."""
    target = tmp_path / "out.json"
    report.write_json(str(target), {"run": 1})

    def half_then_full(self, text, *args, **kwargs):
        with open(self, "w") as f:
            f.write(text[: len(text) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        report.write_json(str(target), {"run": 2, "more": list(range(100))})
    assert json.loads(target.read_text()) == {"run": 1}
    assert _entries(tmp_path) == ["out.json"]
    monkeypatch.undo()
    report.write_json(str(target), {"run": 3})
    assert json.loads(target.read_text()) == {"run": 3}
    assert _entries(tmp_path) == ["out.json"]


# -- store directories --------------------------------------------------------------------------
def test_run_store_dir_missing_or_a_file_is_refused(tmp_path):
    """``run --store-dir`` only holds the run's temporary store: it must exist (a missing one
    is not created, as the default, the system's temporary directory, always exists)."""
    missing = tmp_path / "missing"
    assert_refused(
        tiered_kv("run", *TINY_RUN, "--store-dir", str(missing)),
        "--store-dir",
        str(missing),
        "no such directory",
    )
    (tmp_path / "file").write_text("x")
    assert_refused(
        tiered_kv("run", *TINY_RUN, "--store-dir", str(tmp_path / "file")),
        "--store-dir",
        "is a file",
    )
    assert _entries(tmp_path) == ["file"]


def _read_only_dir(tmp_path) -> str:
    """A directory this process cannot write in: mode 555 for a user; for root (who writes
    there anyway) a read-only mount such as /sys in a container."""
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        return str(ro)
    for cand in ("/sys", "/sys/fs", "/proc/sys"):
        try:
            os.rmdir(tempfile.mkdtemp(dir=cand))
        except OSError:
            return cand
    pytest.skip("no read-only directory here (root writes everywhere)")


def test_run_store_dir_read_only_is_refused(tmp_path):
    ro = _read_only_dir(tmp_path)
    assert_refused(tiered_kv("run", *TINY_RUN, "--store-dir", ro), "--store-dir", "write")


def test_run_reference_store_a_file_or_under_a_missing_directory_is_refused(tmp_path):
    """``run-reference --store`` is kept between runs: a missing one is created when its
    parent exists; under a missing parent (a typo) it is refused."""
    (tmp_path / "file").write_text("x")
    base = ["run-reference", *SMALL["run-reference"]]
    assert_refused(tiered_kv(*base, "--store", str(tmp_path / "file")), "--store", "is a file")
    nowhere = tmp_path / "typo" / "store"
    assert_refused(tiered_kv(*base, "--store", str(nowhere)), "--store", str(nowhere))
    assert _entries(tmp_path) == ["file"]


# -- ports and sizes ----------------------------------------------------------------------------
def test_metrics_port_in_use_is_refused(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = tiered_kv(
            "run", *TINY_RUN, "--metrics-port", str(port), "--store-dir", str(tmp_path)
        )
    assert_refused(done, f"--metrics-port {port}", f"127.0.0.1:{port}")
    assert _entries(tmp_path) == []


def test_run_larger_than_memory_is_refused_naming_the_flags():
    """The default workload at --scale 1000 needs about a TiB: refused at once (it used to
    spend ~50 s, then raise HostMemoryError naming TieredKVConfig.device_tokens)."""
    line = assert_refused(tiered_kv("run", "--scale", "1000"), "--scale 1000", "--users")
    assert "GiB" in line and "available" in line and "device pool" in line


def test_bench_tokens_larger_than_memory_is_refused():
    done = tiered_kv("bench", "--tokens", "100000000", "--no-progress")
    line = assert_refused(done, "--tokens 100000000", "--layers")
    assert "GiB" in line and "available" in line


def test_unloadable_storage_backend_is_refused():
    done = tiered_kv("run", *TINY_RUN, "--storage-backend", "no.such.mod:Klass")
    assert_refused(done, "--storage-backend no.such.mod:Klass", "cannot be loaded")


def test_more_active_users_than_users_is_refused():
    done = tiered_kv("run", "--active-users", "50", "--users", "2")
    assert_refused(done, "--active-users 50", "--users 2", usage=True)


# -- --config -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "content, needle",
    [
        (bytes(range(128, 256)), "not UTF-8"),
        (b"[run\nusers = 1\n", "not TOML"),
        (b'users = "many"\n', "users="),
    ],
    ids=["binary", "malformed", "bad-value"],
)
def test_config_file_that_is_not_a_config_is_refused(tmp_path, content, needle):
    path = tmp_path / "conf.toml"
    path.write_bytes(content)
    assert_refused(tiered_kv("run", "--config", str(path)), "--config", str(path), needle)


def test_stdout_closed_early_ends_quietly():
    """``tiered-kv sim | head -1``: the reader goes away, the command stops with status 141
    (128 + SIGPIPE) and no BrokenPipeError traceback."""
    proc = spawn("sim", *SMALL["sim"])
    proc.stdout.close()  # before the table is printed
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and "BrokenPipe" not in err, err
