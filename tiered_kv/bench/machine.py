"""What the machine was while a benchmark ran, and whether its figures are noisy.

``machine_info`` gathers the details every result records (CPU, memory, versions, device, load
average); ``LoadWatch`` adds the load average before and after the run. ``noise_check`` flags a
run whose baseline moved (max / min of its samples over ``NOISY_SPREAD``, or its IQR / median
over ``NOISY_IQR``) or that shared its cores (1-minute load average per usable core over
``NOISY_LOAD_PER_CORE``): on a shared VM a copy's speed can halve for tens of seconds, and a
ratio taken then says more about the neighbours than about the code.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform as py_platform
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

from tiered_kv.bench.timing import iqr_ratio, spread

NOISY_SPREAD = 1.5
NOISY_IQR = 0.25
NOISY_LOAD_PER_CORE = 1.0
GIB = 1 << 30


class Noise(NamedTuple):
    """Whether a measurement is noisy, and why (empty when it is not)."""

    noisy: bool
    reasons: tuple[str, ...]


def load_average() -> tuple[float, float, float] | None:
    """The 1-, 5- and 15-minute load averages, or None where the OS has none."""
    try:
        one, five, fifteen = os.getloadavg()
    except (AttributeError, OSError):
        return None
    return (round(one, 2), round(five, 2), round(fifteen, 2))


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask), else the CPU count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return py_platform.processor() or py_platform.machine() or "unknown"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(device: Any = None) -> dict[str, Any]:
    """Details of this machine and process as a JSON-ready dict. Reads torch's thread count and
    the device name only if torch is already imported (so this never imports it)."""
    import psutil

    mem = psutil.virtual_memory()
    info: dict[str, Any] = {
        "python": py_platform.python_version(),
        "platform": py_platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "memory_total_gib": round(mem.total / GIB, 1),
        "memory_available_gib": round(mem.available / GIB, 1),
        "load_average": load_average(),
        "versions": {d: _version(d) for d in ("torch", "triton", "numpy", "lmdb")},
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch_threads"] = torch.get_num_threads()
    if device is not None:
        info["device"] = str(device)
        if getattr(device, "type", None) == "cuda" and torch is not None:
            info["device_name"] = torch.cuda.get_device_name(device)
    return info


class LoadWatch:
    """The load average when the watch was made and when ``finish`` is called: the run's
    neighbours, recorded next to its figures."""

    def __init__(self) -> None:
        self.before = load_average()
        self.after: tuple[float, float, float] | None = None

    def finish(self) -> dict[str, Any]:
        """Reads the load average now; returns ``{"load_before", "load_after"}``."""
        self.after = load_average()
        return {"load_before": self.before, "load_after": self.after}


def noise_check(
    baseline_samples: Sequence[float] | None = None,
    loads: Sequence[tuple[float, float, float] | None] = (),
    cpus: int | None = None,
    *,
    max_spread: float = NOISY_SPREAD,
    max_iqr: float = NOISY_IQR,
    max_load_per_core: float = NOISY_LOAD_PER_CORE,
) -> Noise:
    """Flags noise in a baseline's samples (spread or IQR over the limits; a lone sample is not
    judged) or in any of ``loads`` (1-minute load average per usable core over the limit).
    Pure: reads nothing from the machine."""
    reasons = []
    if baseline_samples is not None and len(baseline_samples) >= 2:
        s = spread(baseline_samples)
        if s > max_spread:
            reasons.append(f"baseline spread {s:.2f}x (max / min) > {max_spread:g}x")
        q = iqr_ratio(baseline_samples)
        if q > max_iqr:
            reasons.append(f"baseline IQR {q:.2f} of its median > {max_iqr:g}")
    n = cpus or usable_cpus()
    for load in loads:
        if load is not None and load[0] / n > max_load_per_core:
            reasons.append(
                f"load average {load[0]:.2f} on {n} cores > {max_load_per_core:g} per core"
            )
            break
    return Noise(bool(reasons), tuple(reasons))


def condition_lines(info: dict[str, Any]) -> list[str]:
    """The machine details as the lines a script prints above its table."""
    v = info["versions"]
    load = info["load_average"]
    lines = [
        f"python {info['python']} on {info['platform']}",
        f"cpu {info['cpu_model']}, cpu count {info['cpu_count']} (usable {info['usable_cpus']})",
        "load average " + (" ".join(f"{x:.2f}" for x in load) if load else "unavailable"),
        f"RAM total {info['memory_total_gib']:.1f} GiB, available "
        f"{info['memory_available_gib']:.1f} GiB",
        "versions: " + ", ".join(f"{k} {v[k] or 'unavailable'}" for k in v),
    ]
    if "device" in info:
        name = f" ({info['device_name']})" if "device_name" in info else ""
        threads = info.get("torch_threads")
        lines.append(
            f"device {info['device']}{name}"
            + (f", torch intra-op threads {threads}" if threads else "")
        )
    return lines
