"""``tiered-kv run`` makes OpenMP's threads sleep when they wait, unless the user chose."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tiered_kv.cli import omp_wait


@pytest.fixture
def no_torch(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as in a fresh CLI process


def test_run_takes_the_passive_policy(no_torch, monkeypatch):
    monkeypatch.setattr(omp_wait, "applied", None)
    env: dict[str, str] = {}
    note = omp_wait.apply(["run", "--log-level", "info", "--preset", "llama-3-8b"], env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"} and "OMP_WAIT_POLICY=PASSIVE" in note
    assert omp_wait.applied == note  # what the run prints after its first line


@pytest.mark.parametrize(
    "argv", [["sim", "--trace", "x"], ["bench", "transfer"], ["run-reference"], [], ["--help"]]
)
def test_other_commands_keep_the_default(no_torch, argv):
    env: dict[str, str] = {}
    assert omp_wait.apply(argv, env) is None and env == {}


@pytest.mark.parametrize("var, value", [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "0")])
def test_a_users_choice_stands(no_torch, var, value):
    env = {var: value}
    assert omp_wait.apply(["run"], env) is None and env == {var: value}


def test_nothing_once_torch_is_loaded():
    import torch  # noqa: F401 - libgomp has read its environment

    env: dict[str, str] = {}
    assert omp_wait.apply(["run"], env) is None and env == {}


def test_the_commands_are_the_clis():
    from tiered_kv.cli.main import COMMANDS

    assert set(omp_wait.ALL_COMMANDS) == set(COMMANDS)


def test_the_cli_decides_before_torch_is_imported():
    """The CLI module imports no torch, so main's ``apply`` comes first; the run says so."""
    code = (
        "import sys, tiered_kv.cli.main as m; assert 'torch' not in sys.modules; "
        "print(m.omp_wait.apply(['run'], {}))"
    )
    env = {k: v for k, v in os.environ.items() if k not in omp_wait.USER_VARS}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "OMP_WAIT_POLICY=PASSIVE" in out.stdout


def test_a_run_says_it_after_its_first_line_and_a_refused_one_says_nothing(tmp_path):
    from tests.cli.cli_process import ENV, TINY_RUN, tiered_kv

    env_has_choice = any(v in ENV for v in omp_wait.USER_VARS)
    done = tiered_kv("run", *TINY_RUN, "--store-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert " at scale " in lines[0], lines[0]
    assert ("OMP_WAIT_POLICY=PASSIVE" in lines[1]) != env_has_choice, lines[:2]
    refused = tiered_kv("run", *TINY_RUN, "--store-dir", str(tmp_path / "missing"))
    assert refused.returncode == 2 and refused.stdout == ""  # refused: nothing on stdout
