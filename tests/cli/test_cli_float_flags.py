"""Issue 38: every float flag refuses a value that is not finite (``inf``, ``-inf``, ``nan``,
``1e400``, which Python reads as inf) and one out of its range (zero, negative) while the
arguments are parsed: exit status 2, one error line naming the flag (never a library field such as
``LinkModel.storage_to_host_bytes_per_s``), and no torch imported yet. One process checks them
all (each case is ``main(argv)``, stderr captured)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from tests.cli.cli_process import ENV, ROOT
from tiered_kv.cli.main import build_parser

NOT_FINITE = ("inf", "-inf", "nan", "1e400")
# (command, flag, more bad values than NOT_FINITE: zero and negatives where they are invalid)
FLOATS = [
    ("run", "--scale", ("0", "-1")),
    ("run", "--device-fraction", ("0", "-0.5")),
    ("run", "--host-fraction", ("0", "-0.5")),
    ("run", "--verify-fraction", ("-0.1", "1.5")),
    ("run", "--pcie-gbps", ("0", "-1")),
    ("run", "--disk-gbps", ("0", "-1")),
    ("run", "--metrics-linger", ("-1",)),
    ("sim", "--capacities", ("0", "-1", "0.5,inf")),
    ("sim", "--host-ratio", ("-1",)),
    ("sim", "--storage", ("-1",)),
]

# Importing torch raises (a BaseException: no `except Exception` hides it), so every case is
# checked for it, not only the first that would import it.
PROBE = """
import contextlib, io, json, sys
from tiered_kv.cli.main import main

class TorchImported(BaseException):
    pass

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            raise TorchImported(name)

sys.meta_path.insert(0, NoTorch())
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
        except BaseException as exc:
            code = repr(exc)
    out.append([argv, code, err.getvalue()])
print(json.dumps(out))
"""


def test_every_float_flag_refuses_non_finite_and_out_of_range_values_before_any_work(tmp_path):
    cases = []
    for command, flag, bad in FLOATS:
        more = ["--store-dir", str(tmp_path)] if command == "run" else []
        # --flag=VALUE: argparse takes "-inf" after a space for an option
        cases += [[command, "--no-progress", *more, f"{flag}={v}"] for v in (*NOT_FINITE, *bad)]
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(cases)],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    wrong = []
    for argv, code, err in json.loads(done.stdout):
        flag = argv[-1].partition("=")[0]
        errors = [line for line in err.splitlines() if "error:" in line]
        ok = (
            code == 2
            and "Traceback" not in err
            and len(errors) == 1
            and flag in errors[0]
            and "LinkModel" not in err
        )
        if not ok:
            wrong.append((argv[0], argv[-1], code, errors or err[-300:]))
    assert not wrong, "\n".join(map(str, wrong))
    assert not list(tmp_path.iterdir())


def test_every_float_flag_is_checked_above():
    """A float flag added later is added to FLOATS (a flag whose type takes 0.5 takes floats)."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found = set()
    for command, sub in subparsers.choices.items():
        for action in sub._actions:
            if action.type is None or not action.option_strings:
                continue
            try:
                action.type("0.5")
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                continue
            found.add((command, action.option_strings[0]))
    assert found == {(command, flag) for command, flag, _ in FLOATS}
