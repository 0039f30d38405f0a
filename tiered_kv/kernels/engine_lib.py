"""The copy engine's shared library (``native_build.load_engine``) with its argument types."""

from __future__ import annotations

import ctypes

from tiered_kv.errors import BackendUnavailableError
from tiered_kv.kernels import native_build
from tiered_kv.kernels.row_job import _Rows

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


def lib() -> ctypes.CDLL:
    lib = native_build.load_engine()
    if lib is None:
        raise BackendUnavailableError(f"{native_build.engine_error()}; use kernel_backend='torch'")
    if not getattr(lib, "_tkv_typed", False):
        lib.tkv_engine_start.argtypes = [_I64, _I64]
        lib.tkv_engine_start.restype = _P
        lib.tkv_engine_submit.argtypes = [_P, ctypes.POINTER(_Rows)]
        lib.tkv_engine_submit.restype = ctypes.c_int
        lib.tkv_engine_run.argtypes = [_P, ctypes.POINTER(_Rows)]
        lib.tkv_engine_run.restype = ctypes.c_int
        lib.tkv_engine_wait.argtypes = [_P, _P, _I64, _I64, _I64]
        lib.tkv_engine_wait.restype = _I64
        lib.tkv_engine_stop.argtypes = [_P]
        lib.tkv_engine_stop.restype = None
        lib.tkv_engine_free.argtypes = [_P]
        lib.tkv_engine_free.restype = None
        lib.tkv_rows_copy.argtypes = [ctypes.POINTER(_Rows)]
        lib.tkv_rows_copy.restype = ctypes.c_int
        lib.tkv_rows_copy_layer.argtypes = [ctypes.POINTER(_Rows), _I64]
        lib.tkv_rows_copy_layer.restype = ctypes.c_int
        lib.tkv_status.argtypes = [_P]
        lib.tkv_status.restype = _I64
        lib.tkv_rows_prepare.argtypes = [_P, _P, _I64, _I64, _I64, _I64, _P, _P] + [_I64] * 4 + [_P]
        lib.tkv_rows_prepare.restype = _I64
        lib._tkv_typed = True
    return lib


def available() -> bool:
    """Whether the engine's library builds and loads here."""
    return native_build.load_engine() is not None


# Below this many bytes per status entry a job stays on the copier thread alone.
