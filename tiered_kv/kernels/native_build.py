"""Build and load the native libraries on first use: the block copier (``native/copy_blocks.c``)
and the copy engine (``native/copy_engine.c`` with ``copy_rows.c`` and ``index_check.c``).

Each shared library is compiled once with the system C compiler (``$CC``, else ``cc``/``gcc``)
into a cache folder keyed by the source's hash, then loaded with ctypes. Where no compiler works
the native path is unavailable and :func:`load` says why; callers fall back to the torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from tiered_kv import platform
from tiered_kv.errors import BackendUnavailableError

SOURCE = Path(__file__).with_name("native") / "copy_blocks.c"
_NATIVE = Path(__file__).with_name("native")
ENGINE_SOURCES = tuple(_NATIVE / n for n in ("copy_engine.c", "copy_rows.c", "index_check.c"))
ENGINE_HEADERS = (_NATIVE / "copy_rows.h",)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None
_engine_lib: ctypes.CDLL | None = None
_engine_error: str | None = None


def cache_dir() -> Path:
    """Where the library is built (``platform.cache_dir``)."""
    return platform.cache_dir()


def _compiler() -> str | None:
    for name in platform.c_compilers():
        if shutil.which(name):
            return name
    return None


def _build(target: Path, sources: Path | tuple[Path, ...] = SOURCE) -> None:
    cc = _compiler()
    if cc is None:
        raise BackendUnavailableError(
            "no C compiler found (tried $CC, cc, gcc, clang); set CC or install gcc"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        files = [str(sources)] if isinstance(sources, Path) else [str(x) for x in sources]
        cmd = [cc, "-O3", "-shared", "-fPIC", "-pthread", *files, "-o", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BackendUnavailableError(
                f"{' '.join(cmd)} failed with exit code {proc.returncode}: "
                f"{proc.stderr.strip()[:500]}; set CC to a working C compiler"
            )
        os.replace(out, target)  # atomic: concurrent builders never load a half-written file


def load() -> ctypes.CDLL | None:
    """The loaded library, building it if needed; None (with :func:`error`) if impossible."""
    global _lib, _error
    with _lock:
        if _lib is not None or _error is not None:
            return _lib
        try:
            lib = _built(SOURCE)
            fn = lib.tkv_copy_blocks
            fn.argtypes = [
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_int64,
                ctypes.c_int64,
                ctypes.c_int,
                ctypes.c_int,
            ]
            fn.restype = ctypes.c_int
            _lib = lib
        except Exception as exc:  # no compiler, unwritable cache, foreign platform
            _error = f"native block copier unavailable: {exc}"
        return _lib


def error() -> str | None:
    load()
    return _error


def _built(sources: Path | tuple[Path, ...], headers: tuple[Path, ...] = ()) -> ctypes.CDLL:
    files = (sources,) if isinstance(sources, Path) else sources
    h = hashlib.sha256()
    for f in (*files, *headers):
        h.update(f.read_bytes())
    digest = h.hexdigest()[:16]
    tag = f"{sys.platform}-{os.uname().machine}" if hasattr(os, "uname") else sys.platform
    target = cache_dir() / f"{files[0].stem}-{digest}-{tag}.so"
    if not target.exists():
        _build(target, sources)
    return ctypes.CDLL(str(target))


def load_engine() -> ctypes.CDLL | None:
    """The copy engine's library (argument types set by ``kernels.copy_engine``), building it
    if needed; None (with :func:`engine_error`) if impossible."""
    global _engine_lib, _engine_error
    with _lock:
        if _engine_lib is not None or _engine_error is not None:
            return _engine_lib
        try:
            _engine_lib = _built(ENGINE_SOURCES, ENGINE_HEADERS)
        except Exception as exc:  # no compiler, unwritable cache, foreign platform
            _engine_error = f"native copy engine unavailable: {exc}"
        return _engine_lib


def engine_error() -> str | None:
    load_engine()
    return _engine_error
