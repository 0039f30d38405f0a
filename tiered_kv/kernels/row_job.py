"""What the copy engine copies: a job described the way ``native/copy_rows.c`` walks it.

:class:`RowShape` is what every transfer of one host pool shares (device buffer base
addresses, row and part sizes, the layer order); :class:`RowJob` adds one transfer's device rows
and host record offsets; ``_Rows`` is the C descriptor both become. ``engine_threads`` says how
many threads an asynchronous job may use (``sync_threads``: a synchronous one).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tiered_kv.errors import InvalidArgumentError

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


class _Rows(ctypes.Structure):
    """``tkv_rows`` of copy_engine.c, field for field."""

    _fields_ = [
        ("n", _I64),
        ("dev_rows", _P),
        ("host_tok", _P),
        ("host_base", _I64),
        ("host_layer_bytes", _I64),
        ("nparts", _I64),
        ("dev_bases", _P),
        ("row_bytes", _P),
        ("part_bytes", _P),
        ("total_layers", _I64),
        ("nlayers", _I64),
        ("layers", _P),
        ("to_host", _I64),
        ("whole", _I64),
        ("chunked", _I64),
        ("threads", _I64),
        ("nt", _I64),
        ("status", _P),
        ("ns", _P),
    ]


HELPERS_MIN_BYTES = 1 << 20
COPY_THREADS_ENV = "TIERED_KV_COPY_THREADS"


def free_cores() -> int:
    """Cores this thread may run on that the compute threads (torch's intra-op threads) leave
    free; 0 when they take every one."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    return max(0, usable - torch.get_num_threads())


def copy_threads_setting() -> int | None:
    """``TIERED_KV_COPY_THREADS`` as a positive int, or None when unset. Raises
    InvalidArgumentError naming the value when it is set to anything else."""
    raw = os.environ.get(COPY_THREADS_ENV)
    if raw is None or raw.strip() == "":
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= 64:
        raise InvalidArgumentError(
            f"{COPY_THREADS_ENV}={raw!r}: give a thread count 1..64, or unset it to follow the "
            "cores the compute threads leave free"
        )
    return n


def engine_threads(entry_bytes: int) -> int:
    """Threads an asynchronous job may use beside the model's compute: the copier alone for
    entries under ``HELPERS_MIN_BYTES``, else ``TIERED_KV_COPY_THREADS`` if set, else the copier
    plus one helper per core the compute threads leave free (``free_cores``), so copies never
    take a core the model runs on, however many cores the machine or its affinity gives."""
    if entry_bytes < HELPERS_MIN_BYTES:
        return 1
    setting = copy_threads_setting()
    if setting is not None:
        return setting
    return max(1, free_cores())


def sync_threads(entry_bytes: int) -> int:
    """Threads a synchronous copy may use, its caller among them: the caller is the compute
    thread and waits, so the copy takes the compute threads' cores (one per torch thread), not
    the free ones (another process's, such as vLLM's engine core on a reserved core); one
    thread under ``HELPERS_MIN_BYTES``."""
    if entry_bytes < HELPERS_MIN_BYTES:
        return 1
    setting = copy_threads_setting()
    if setting is not None:
        return setting
    return max(1, torch.get_num_threads())


_beside = threading.local()


def run_beside_compute() -> None:
    """Mark the calling thread as one that copies while the model computes (a connector's load
    or save thread; a ``ThreadPoolExecutor`` initializer): its copies take ``engine_threads``,
    not the compute threads' cores."""
    _beside.on = True


def copy_threads(entry_bytes: int) -> int:
    """``engine_threads`` on a thread marked by ``run_beside_compute``, else ``sync_threads``."""
    if getattr(_beside, "on", False):
        return engine_threads(entry_bytes)
    return sync_threads(entry_bytes)


def _i64(values) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.int64)


class RowShape:
    """What every transfer of one host pool shares (the device pool's buffers and the host
    buffer never move): device base addresses, row and part sizes, layer order. Built once."""

    __slots__ = (
        "dev_bases",
        "row_bytes",
        "part_bytes",
        "layers",
        "host_base",
        "host_layer_bytes",
        "token_bytes",
        "keep",
        "_addr",
    )

    def __init__(
        self,
        dev_bases: np.ndarray,
        row_bytes: Sequence[int] | np.ndarray,
        part_bytes: Sequence[int] | np.ndarray,
        host_base: int,
        host_layer_bytes: int,
        keep: tuple = (),
        layers: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        self.dev_bases = _i64(dev_bases)  # (total_layers, nparts)
        self.row_bytes = _i64(row_bytes)
        self.part_bytes = _i64(part_bytes)
        every = np.arange(self.dev_bases.shape[0], dtype=np.int64)
        self.layers = every if layers is None else _i64(layers)  # local layers, copy order
        self.host_base = host_base
        self.host_layer_bytes = host_layer_bytes
        self.token_bytes = int(self.row_bytes.sum())  # one token of one layer, every part
        self.keep = keep
        self._addr = tuple(
            a.ctypes.data for a in (self.dev_bases, self.row_bytes, self.part_bytes, self.layers)
        )

    @property
    def total_layers(self) -> int:
        return self.dev_bases.shape[0]

    def with_layers(self, layers: Sequence[int] | np.ndarray) -> RowShape:
        """The same shape copying local ``layers`` in that order (the engine refuses a layer
        outside ``0 .. total_layers - 1``, that layer alone)."""
        return RowShape(
            self.dev_bases,
            self.row_bytes,
            self.part_bytes,
            self.host_base,
            self.host_layer_bytes,
            self.keep,
            layers,
        )


@dataclass
class RowJob:
    """One validated row copy of every layer in ``shape`` (``copy_engine.c`` says what each
    field means): device rows, and each token's layer-0 host record offset in bytes. ``whole``
    gives the job one status entry instead of one per layer; ``keep`` holds the tensors the
    row arrays view."""

    shape: RowShape
    dev_rows: torch.Tensor  # int64, CPU
    host_tok: torch.Tensor  # int64, CPU
    to_host: bool
    whole: bool
    chunked: bool = False
    threads: int = 1
    nt: bool = False
    keep: tuple = field(default=(), repr=False)

    def __post_init__(self) -> None:
        for name in ("dev_rows", "host_tok"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                t = torch.as_tensor(t)
            if t.dtype is not torch.int64 or t.device.type != "cpu" or not t.is_contiguous():
                setattr(self, name, t.to("cpu", torch.int64).contiguous())
            else:
                setattr(self, name, t)

    @property
    def layers(self) -> np.ndarray:
        return self.shape.layers

    @property
    def entries(self) -> int:
        """Status entries: 1 for a whole job, else one per layer."""
        return 1 if self.whole else self.shape.layers.size

    @property
    def nbytes(self) -> int:
        return int(self.dev_rows.numel() * self.shape.layers.size * self.shape.token_bytes)

    def struct(self, track: np.ndarray | None) -> _Rows:
        """The C descriptor; ``track`` holds the status entries, then their durations."""
        sh = self.shape
        bases, rows, parts, layers = sh._addr
        status = track.ctypes.data if track is not None else None
        return _Rows(
            self.dev_rows.numel(),
            self.dev_rows.data_ptr(),
            self.host_tok.data_ptr(),
            sh.host_base,
            sh.host_layer_bytes,
            sh.dev_bases.shape[1],
            bases,
            rows,
            parts,
            sh.total_layers,
            sh.layers.size,
            layers,
            int(self.to_host),
            int(self.whole),
            int(self.chunked),
            self.threads,
            int(self.nt),
            status,
            status + 8 * self.entries if status is not None else None,
        )
