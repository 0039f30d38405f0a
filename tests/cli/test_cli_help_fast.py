"""Issue 30: building the parser and ``--help`` of every subcommand import no torch (they took
2-5 s); the plain copies of the engine's values the parser shows (``cli.run_defaults``) equal
the engine's."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from tests.cli.cli_process import ENV, ROOT
from tiered_kv.cli import run_defaults
from tiered_kv.errors import InvalidArgumentError

PROBE = """
import contextlib, io, sys
from tiered_kv.cli.main import build_parser, main
build_parser()
for argv in ([], ["run"], ["run-reference"], ["sim"], ["bench"]):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            main([*argv, "--help"])
        except SystemExit as exc:
            assert exc.code == 0, (argv, exc.code)
    assert out.getvalue().startswith("usage: tiered-kv"), argv
heavy = sorted(m for m in ("torch", "triton", "numpy", "lmdb") if m in sys.modules)
print("heavy:", heavy)
"""


def test_parser_and_help_import_no_torch():
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, env=ENV, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "heavy: []" in done.stdout, done.stdout


def test_run_defaults_are_the_engines():
    from tiered_kv.cli.scale_cmd import SERVED_KINDS
    from tiered_kv.engine.presets import PRESETS
    from tiered_kv.engine.scale_workload import PRESET_COST_MODELS, PRESET_SCALES, ScaleConfig
    from tiered_kv.engine.synthetic_model import LinkModel

    served = tuple(p for p, v in PRESETS.items() if v.to_geometry().model in SERVED_KINDS)
    assert run_defaults.SERVED == served
    assert run_defaults.PRESET_SCALES == PRESET_SCALES
    assert run_defaults.PRESET_COST_MODELS == PRESET_COST_MODELS
    engine = dataclasses.asdict(ScaleConfig(scale=1.0))
    assert vars(run_defaults.SCALE) == {k: engine[k] for k in vars(run_defaults.SCALE)}
    links = LinkModel()
    assert run_defaults.PCIE_GBPS * 1e9 == links.host_to_device_bytes_per_s
    assert run_defaults.DISK_GBPS * 1e9 == links.storage_to_host_bytes_per_s
    # The parser's bound on --scale is ScaleConfig's: just under it is a config, it is not.
    assert ScaleConfig(scale=run_defaults.MAX_SCALE * (1 - 1e-9)).scale < run_defaults.MAX_SCALE
    with pytest.raises(InvalidArgumentError, match="scale="):
        ScaleConfig(scale=run_defaults.MAX_SCALE)


def test_every_run_flag_that_is_a_scale_config_field_defaults_to_the_engines():
    """No field the parser shows was left out of ``run_defaults.SCALE`` (or given another
    default elsewhere)."""
    from tiered_kv.cli.main import build_parser
    from tiered_kv.engine.scale_workload import ScaleConfig

    args = build_parser().parse_args(["run"])
    engine = ScaleConfig()
    shown = [f.name for f in dataclasses.fields(ScaleConfig) if f.name not in ("links", "scale")]
    assert len(shown) > 15
    for name in shown:
        assert getattr(args, name) == getattr(engine, name), name
