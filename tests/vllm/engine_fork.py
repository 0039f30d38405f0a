"""A fork server for the test engines: one process imports vLLM once, then forks every engine.

Importing vLLM costs ~13 s of the ~20 s an in-process engine takes on 2 cores (and as much in
front of an engine with worker processes); the vLLM stage starts ~30 engines. ``ForkHost``
starts ``engine_proc.py --host``, which imports vLLM and then, per request, forks a child that
leads its own process group, sends its output to the run's log, takes the run's environment
and runs ``engine_proc._child`` on its spec: the same child a fresh interpreter would run, less
the import. vLLM's own worker processes are spawned fresh by the child, as before (the CPU
platform forces ``spawn``), in the child's process group.

A run whose environment differs from the host's in a variable an imported module may have read
(``IMPORT_TIME_PREFIXES``, less ``FORKABLE_ENV``: read when an engine starts), a host that
failed to start, or ``TIERED_KV_VLLM_FORK=0`` take a fresh interpreter; the forked child runs
with the run's whole environment. A forked child is
reaped by the host, which writes its exit status next to the run's output (``<out>.rc``)."""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

# Variables an imported module may have read: a run that changes one of these gets a fresh
# interpreter, unless it is one read when an engine starts (FORKABLE_ENV).
IMPORT_TIME_PREFIXES = (
    "VLLM_", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "HF_", "TRANSFORMERS_", "TOKENIZERS_",
    "CUDA", "PYTHON", "LD_", "TRITON", "TIERED_KV_",
)  # fmt: skip
FORKABLE_ENV = frozenset(
    {"VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"}
)
READY = "engine-host-ready"
HOST_START_TIMEOUT = 180.0


class ForkedChild:
    """A forked engine child, waited for like a ``subprocess.Popen`` (``pid``, ``poll``,
    ``wait``): its exit status is the host's ``<out>.rc`` file."""

    def __init__(self, pid: int, rc_path: Path, host: ForkHost) -> None:
        self.pid = pid
        self._rc_path = rc_path
        self._host = host
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._rc_path.exists():
            self.returncode = int(self._rc_path.read_text())
        if self.returncode is None and not self._host.alive():
            self.returncode = -9  # the host died: nobody reaps or reports this child
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked engine {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


class ForkHost:
    """The parent's side: the host process and its request pipe."""

    def __init__(self, script: Path, env: dict) -> None:
        self.env = dict(env)
        self._proc = subprocess.Popen(
            [sys.executable, str(script), "--host"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
            text=True,
        )
        line = self._read_line(HOST_START_TIMEOUT)
        if line != READY:
            self.close()
            raise RuntimeError(f"the engine host did not start (said {line!r})")

    def alive(self) -> bool:
        return self._proc.poll() is None

    def can_fork(self, env: dict) -> bool:
        if not self.alive():
            return False
        return not _import_time_changes(env, self.env)

    def start(self, spec_path: Path, out_path: Path, log_path: Path, env: dict) -> ForkedChild:
        request = {"spec": str(spec_path), "out": str(out_path), "log": str(log_path), "env": env}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        line = self._read_line(60.0)
        if not line.isdigit():
            self.close()
            raise RuntimeError(f"the engine host did not fork (said {line!r})")
        return ForkedChild(int(line), Path(f"{out_path}.rc"), self)

    def _read_line(self, timeout: float) -> str:
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        return self._proc.stdout.readline().strip() if ready else ""

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


_HOST: ForkHost | None = None
_HOST_FAILED = False


def host_for(script: Path, env: dict) -> ForkHost | None:
    """The session's host if ``env`` can be forked from it (started on first use), else None."""
    global _HOST, _HOST_FAILED
    if os.environ.get("TIERED_KV_VLLM_FORK", "1") == "0" or _HOST_FAILED:
        return None
    if _HOST is None or not _HOST.alive():
        base = {k: v for k, v in env.items() if k not in FORKABLE_ENV}  # the child sets those
        try:
            _HOST = ForkHost(script, base)
        except (OSError, RuntimeError):
            _HOST_FAILED = True
            return None
        atexit.register(_HOST.close)
    return _HOST if _HOST.can_fork(env) else None


def _import_time_changes(env: dict, base: dict) -> list[str]:
    keys = (set(env) | set(base)) - FORKABLE_ENV
    return sorted(
        k for k in keys if k.startswith(IMPORT_TIME_PREFIXES) and env.get(k) != base.get(k)
    )


# --- the host process ---------------------------------------------------------------------------


def serve(child: Callable[[str, str], None]) -> None:
    """The host's loop (``engine_proc.py --host``): import vLLM, say ready, then one forked
    ``child(spec, out)`` per request line, reaped, its status written to ``<out>.rc``."""
    from vllm import LLM, SamplingParams  # noqa: F401 - the import every child is spared
    from vllm.config import KVTransferConfig  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401

    print(READY, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(child, request)  # never returns
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        rc_path = Path(f"{request['out']}.rc")
        tmp = rc_path.with_suffix(".rctmp")
        tmp.write_text(str(os.waitstatus_to_exitcode(status)))
        tmp.rename(rc_path)


def _run_child(child: Callable[[str, str], None], request: dict) -> None:
    code = 1
    try:
        os.setsid()  # its own process group, as a fresh child's: killed as one
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        child(request["spec"], request["out"])
        code = 0
    except BaseException:  # noqa: BLE001 - the child's failure goes to its log and status
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
