"""How the OpenMP threads of a ``tiered-kv run`` wait: asleep, not spinning (``OMP_WAIT_POLICY``).

torch's CPU kernels run on OpenMP threads that, by default, spin at the end of every parallel
region. On a machine that is also running something else a spinning thread holds a core that a
descheduled peer needs to reach the same barrier. Measured on the 2-core VM, the Qwen3-Next
preset's ``device_only`` mode (one round; torch threads 2): 13.4-14.1 s quiet and 64.8 s beside
three busy processes (load ~4.8) with the default, against 14.4-15.4 s and 38.2 s with
``OMP_WAIT_POLICY=PASSIVE`` (CPU seconds beside the load: 49.6 against 22.3). A run is a
long batch job on shared machines, so it takes ``PASSIVE`` unless the user chose a policy
(``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set). libgomp reads the variable when it is loaded,
with torch: ``apply`` runs before anything imports torch, and the run prints what it did
after its first line (a run refused at the start prints nothing on stdout).
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping, Sequence

COMMANDS = ("run",)  # the commands whose process takes the policy
applied: str | None = None  # what ``apply`` did in this process (the run prints it), if anything
ALL_COMMANDS = ("run", "run-reference", "sim", "bench")  # cli.main's
USER_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def apply(argv: Sequence[str], environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` in ``environ`` for a command of ``COMMANDS`` (the first
    argument of ``argv`` that names a command) when no variable of ``USER_VARS`` is set and
    torch is not imported yet; the line that says what was done, or None when nothing was."""
    command = next((a for a in argv if a in ALL_COMMANDS), None)
    if command not in COMMANDS or any(v in environ for v in USER_VARS):
        return None
    if "torch" in sys.modules:  # too late: libgomp has read its environment
        return None
    global applied
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    applied = (
        "OpenMP threads sleep when they wait (OMP_WAIT_POLICY=PASSIVE, tiered-kv run's default: "
        "set OMP_WAIT_POLICY to choose)"
    )
    return applied
