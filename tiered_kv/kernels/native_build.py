"""Build and load the native libraries on first use: the block copier (``native/copy_blocks.c``),
the copy engine (``native/copy_engine.c`` with ``copy_rows.c`` and ``index_check.c``) and the
HiSparse swap-in bookkeeping (``native/swap_plan.c``).

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
ENGINE_HEADERS = (_NATIVE / "copy_rows.h", _NATIVE / "copy_row.h")
BLOCK_HEADERS = (_NATIVE / "copy_row.h",)
SWAP_PLAN = _NATIVE / "swap_plan.c"

_lock = threading.Lock()
# key -> (library, None) once loaded, or (None, why not) once it failed
_loaded: dict[str, tuple[ctypes.CDLL | None, str | None]] = {}


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


def _type_copy_blocks(lib: ctypes.CDLL) -> None:
    fn = lib.tkv_copy_blocks
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 2
    fn.restype = ctypes.c_int


def _load(key: str, what: str, files: tuple[Path, ...], setup=None) -> ctypes.CDLL | None:
    """Library ``key`` (built from ``files``: sources, then headers), loaded once per process;
    None once it failed (the reason in ``_loaded[key]``)."""
    done = _loaded.get(key)
    if done is not None:
        return done[0]
    with _lock:
        done = _loaded.get(key)
        if done is None:
            try:
                lib = _built(tuple(f for f in files if f.suffix == ".c"), files)
                if setup is not None:
                    setup(lib)
                done = (lib, None)
            except Exception as exc:  # no compiler, unwritable cache, foreign platform
                done = (None, f"{what} unavailable: {exc}")
            _loaded[key] = done
        return done[0]


def load() -> ctypes.CDLL | None:
    """The block copier's library, building it if needed; None (with :func:`error`) if
    impossible."""
    return _load("blocks", "native block copier", (SOURCE, *BLOCK_HEADERS), _type_copy_blocks)


def _type_swap_plan(lib: ctypes.CDLL) -> None:
    fn = lib.tkv_swap_plan
    p, i = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i, i, p, p, i, i, p, p, p, p]
    fn.restype = ctypes.c_int


def load_swap_plan() -> ctypes.CDLL | None:
    """The HiSparse swap-in bookkeeping (``native/swap_plan.c``), building it if needed; None
    (with :func:`swap_plan_error`) if impossible."""
    return _load("swap_plan", "native swap-in bookkeeping", (SWAP_PLAN,), _type_swap_plan)


def swap_plan_error() -> str | None:
    load_swap_plan()
    return _loaded["swap_plan"][1]


def error() -> str | None:
    load()
    return _loaded["blocks"][1]


def _built(sources: tuple[Path, ...], hashed: tuple[Path, ...]) -> ctypes.CDLL:
    h = hashlib.sha256()
    for f in hashed:
        h.update(f.read_bytes())
    digest = h.hexdigest()[:16]
    tag = f"{sys.platform}-{os.uname().machine}" if hasattr(os, "uname") else sys.platform
    target = cache_dir() / f"{sources[0].stem}-{digest}-{tag}.so"
    if not target.exists():
        _build(target, sources)
    return ctypes.CDLL(str(target))


def load_engine() -> ctypes.CDLL | None:
    """The copy engine's library (argument types set by ``kernels.engine_lib``), building it
    if needed; None (with :func:`engine_error`) if impossible."""
    return _load("engine", "native copy engine", (*ENGINE_SOURCES, *ENGINE_HEADERS))


def engine_error() -> str | None:
    load_engine()
    return _loaded["engine"][1]
