"""Where tensors live and which kernel path runs, decided once per process.

Kernel paths: ``triton`` (compiled on CUDA; the Triton interpreter on CPU), ``torch`` (the
reference implementation of every kernel) and ``native`` (a small C block copier compiled on first
use; CPU page transfers only). ``auto`` picks Triton on CUDA; on CPU, where the interpreter is
correct but slow, it picks ``native`` for page transfers (when a C compiler is present) and
``torch`` for everything else. Environment variables are read here and nowhere else:

- ``TIERED_KV_KERNEL_BACKEND``: ``auto`` (default), ``triton``, ``torch`` or ``native``;
- ``TIERED_KV_DEVICE``: the default device (``cuda``, ``cuda:1``, ``cpu``); default ``cuda`` when
  available, else ``cpu``;
- ``TIERED_KV_CACHE_DIR`` (else ``$XDG_CACHE_HOME/tiered_kv``, else ``~/.cache/tiered_kv``): where
  the native copier is built and ``tiered-kv run-reference`` keeps its store;
- ``CC``: the C compiler tried first for the native copier;
- ``TIERED_KV_DEBUG``: ``1`` turns on the allocators' debug mode (checks that read index
  values: ranges, double frees, ``last_loc`` and length consistency; a device sync each on
  CUDA) for every allocator built without an explicit ``debug_mode=``; default off. The test
  suite sets it.

Tests override the choice with :func:`use_kernel_backend`. GPU-only imports stay lazy, so
``import tiered_kv`` works on any machine.
"""

from __future__ import annotations

import contextlib
import enum
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

from tiered_kv.errors import BackendUnavailableError, InvalidArgumentError

ENV_KERNEL_BACKEND = "TIERED_KV_KERNEL_BACKEND"
ENV_DEVICE = "TIERED_KV_DEVICE"
ENV_CACHE_DIR = "TIERED_KV_CACHE_DIR"
ENV_DEBUG = "TIERED_KV_DEBUG"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


class KernelBackend(str, enum.Enum):
    TRITON = "triton"
    TORCH = "torch"
    NATIVE = "native"


_lock = threading.Lock()
_override: KernelBackend | None = None
_triton: ModuleType | None = None
_triton_error: str | None = None


def cache_dir() -> Path:
    """``$TIERED_KV_CACHE_DIR``, else ``$XDG_CACHE_HOME/tiered_kv``, else ``~/.cache/tiered_kv``."""
    if os.environ.get(ENV_CACHE_DIR):
        return Path(os.environ[ENV_CACHE_DIR])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tiered_kv"


def c_compilers() -> list[str]:
    """C compilers to try, in order: ``$CC`` first when set."""
    return [c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c]


def debug_mode() -> bool:
    """Whether allocators built without ``debug_mode=`` check index values:
    ``TIERED_KV_DEBUG`` (``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``/unset),
    read at each construction."""
    text = os.environ.get(ENV_DEBUG, "").strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise InvalidArgumentError(
        f"{ENV_DEBUG}={os.environ[ENV_DEBUG]!r} is not a switch; use 1 (on) or 0 (off)"
    )


def cuda_available() -> bool:
    return torch.cuda.is_available()


def default_device() -> torch.device:
    """The device pools use when none is given: ``TIERED_KV_DEVICE``, else cuda if present."""
    name = os.environ.get(ENV_DEVICE, "").strip()
    if name:
        return resolve_device(name)
    return torch.device("cuda" if cuda_available() else "cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """Turn a user-supplied device into a ``torch.device``, refusing one this process lacks."""
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(
            f"device {device!r} is not a torch device; use 'cpu', 'cuda' or 'cuda:N'"
        ) from exc
    if dev.type == "cuda" and not cuda_available():
        why = "torch was built without it" if torch.version.cuda is None else "no GPU is visible"
        raise BackendUnavailableError(
            f"device {device!r} requested but CUDA is not available in this process ({why}); "
            "the devices here: 'cpu'"
        )
    if dev.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"device {device!r} is not supported; use 'cpu' or 'cuda'")
    return dev


def import_triton() -> ModuleType | None:
    """Import Triton once. Without CUDA the interpreter is switched on before the first import,
    because Triton reads ``TRITON_INTERPRET`` when its language module is imported."""
    global _triton, _triton_error
    with _lock:
        if _triton is not None or _triton_error is not None:
            return _triton
        if "triton" not in sys.modules and not cuda_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        try:
            import triton  # noqa: PLC0415 - lazy on purpose
        except Exception as exc:  # pragma: no cover - depends on the install
            _triton_error = f"triton failed to import: {exc!r}"
            return None
        _triton = triton
        return triton


def triton_interpreted() -> bool:
    """True when Triton kernels run under the interpreter (a CPU-only process)."""
    triton = import_triton()
    if triton is None:
        return False
    return bool(triton.knobs.runtime.interpret)


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels can run on tensors of ``device`` in this process."""
    triton = import_triton()
    if triton is None:
        return False
    if device.type == "cuda":
        return not triton_interpreted()
    return triton_interpreted()


def _parse_backend(value: str | KernelBackend, where: str) -> KernelBackend | None:
    if isinstance(value, KernelBackend):
        return value
    text = str(value).strip().lower()
    if text in ("", "auto"):
        return None
    try:
        return KernelBackend(text)
    except ValueError:
        raise InvalidArgumentError(
            f"{where}={value!r} is not a kernel backend; use 'auto', 'triton', 'torch' or 'native'"
        ) from None


NativeProbe = Callable[[], "str | None"]  # None when the native copier loads, else why not


def kernel_backend(
    device: torch.device,
    requested: str | KernelBackend | None = None,
    *,
    native: NativeProbe | None = None,
) -> KernelBackend:
    """The kernel path for tensors on ``device``: an explicit request, then the test override,
    then ``TIERED_KV_KERNEL_BACKEND``, then ``auto``. ``native``: the caller has a native
    implementation (page transfers) and this probe says whether it loads (the kernels package
    passes it, so this module never imports the kernels); for others a ``native`` choice from
    the override or the environment means torch, and an explicit ``native`` request is
    refused."""
    native_ok = native is not None
    choice = None
    explicit = False
    if requested is not None:
        choice = _parse_backend(requested, "kernel_backend")
        explicit = choice is not None
    if choice is None and _override is not None:
        choice = _override
    if choice is None:
        choice = _parse_backend(os.environ.get(ENV_KERNEL_BACKEND, "auto"), ENV_KERNEL_BACKEND)
    if choice is None:
        if device.type == "cuda" and triton_runs_on(device):
            return KernelBackend.TRITON
        if device.type == "cpu" and native_ok and native() is None:
            return KernelBackend.NATIVE
        return KernelBackend.TORCH
    if choice is KernelBackend.TRITON and not triton_runs_on(device):
        raise BackendUnavailableError(
            f"kernel backend 'triton' cannot run on device {device}: "
            + (_triton_error or "Triton was imported without the interpreter before tiered_kv")
            + "; use kernel_backend='torch'"
        )
    if choice is KernelBackend.NATIVE:
        if not native_ok:
            if explicit:
                raise BackendUnavailableError(
                    "kernel backend 'native' exists only for page transfers; use 'triton' or "
                    "'torch' here"
                )
            return KernelBackend.TORCH
        if device.type != "cpu":
            raise BackendUnavailableError(
                f"kernel backend 'native' copies CPU memory only, not {device}; use 'triton'"
            )
        reason = native()
        if reason is not None:
            raise BackendUnavailableError(f"{reason}; use kernel_backend='torch'")
    return choice


@contextlib.contextmanager
def use_kernel_backend(backend: str | KernelBackend | None) -> Iterator[None]:
    """Override the kernel path for objects constructed inside the block (tests)."""
    global _override
    previous = _override
    _override = _parse_backend(backend, "backend") if backend is not None else None
    try:
        yield
    finally:
        _override = previous
