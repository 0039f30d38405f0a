"""Native page-transfer launcher (CPU): one call of the C block copier per transfer or layer.

:class:`NativeRowPlan` computes the block addresses of a transfer with broadcast torch ops,
straight into copy order, and keeps them; running it then costs one C call. ``transfer_rows``
keeps the plan in the caller's :class:`PlanCache`, so the calls of a layer-wise load (one per
layer, same arguments) share one plan; a layer's addresses are built when that layer is first
copied, so layer 0 does not wait for the addresses of every layer. A cached plan is used only
while the arguments are the objects it was built from and the index tensors are unmodified
(``_version``); otherwise it is rebuilt.
Orders: host-bound copies of every layer in a token-major layout go in chunks of ``CHUNK``
consecutive tokens, layer by layer, part by part (each chunk fills one region of the host while
reading runs of device rows); other copies go layer-major, so one layer is one contiguous slice
of the address arrays. Large copies use several threads and non-temporal stores. Same contract
as ``transfer_reference.transfer_rows``; the caller has validated every index. ``copy_blocks``
is the C call alone, on addresses a caller computed itself (no plan kept).
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from tiered_kv.errors import BackendUnavailableError, TransferError
from tiered_kv.kernels import native_build
from tiered_kv.kernels.row_job import copy_threads
from tiered_kv.kernels.transfer_reference import PlanCache

# Below this size a cache bypass costs more than it saves (threads: ``row_job.copy_threads``).
STREAM_MIN_BYTES = 4 << 20
# Tokens per chunk of a host-bound token-major copy (measured: 16 beat 1 by 10-15%).
CHUNK = 16

Buffers = tuple[tuple[torch.Tensor, ...], ...]


def _chunked(a: np.ndarray) -> np.ndarray:
    """(layers, n, parts) -> flat, ordered (n / CHUNK, layers, parts, CHUNK), tail last."""
    layers, n, parts = a.shape
    whole = n // CHUNK * CHUNK
    head = a[:, :whole].reshape(layers, n // CHUNK, CHUNK, parts).transpose(1, 0, 3, 2).ravel()
    tail = a[:, whole:].transpose(1, 0, 2).ravel()
    return np.concatenate([head, tail])


def _flat(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).ravel()


def _frozen(dev_buffers: Sequence[Sequence[torch.Tensor]]) -> Buffers:
    if isinstance(dev_buffers, tuple) and all(isinstance(b, tuple) for b in dev_buffers):
        return dev_buffers
    return tuple(tuple(bufs) for bufs in dev_buffers)


def _same_buffers(given: Sequence[Sequence[torch.Tensor]], kept: Buffers) -> bool:
    # A tuple of tuples cannot change, so the same object holds the same tensors.
    if given is kept:
        return True
    return len(given) == len(kept) and all(
        len(g) == len(k) and all(a is b for a, b in zip(g, k, strict=True))
        for g, k in zip(given, kept, strict=True)
    )


_BASES: dict[int, tuple[list[weakref.ref], np.ndarray]] = {}


def bases_of(dev_buffers: Buffers) -> np.ndarray:
    """(layers, parts) base addresses, kept per buffer tuple: a caller that hands the same
    tuple to every transfer (the host pool does) pays for them once. Only weak references are
    kept (a dropped pool's memory is freed); the entry counts only while each is the same
    tensor object, so a reused id never matches."""
    flat = [t for bufs in dev_buffers for t in bufs]
    kept = _BASES.get(id(dev_buffers))
    if kept is not None and len(kept[0]) == len(flat):
        if all(r() is t for r, t in zip(kept[0], flat, strict=True)):
            return kept[1]
    layers = len(dev_buffers[0])
    bases = np.array(
        [[bufs[i].data_ptr() for bufs in dev_buffers] for i in range(layers)], dtype=np.int64
    )
    if len(_BASES) >= 16:
        _BASES.clear()
    _BASES[id(dev_buffers)] = ([weakref.ref(t) for t in flat], bases)
    return bases


class NativeRowPlan:
    """The block list of one transfer (see ``transfer_reference.transfer_rows``)."""

    def __init__(
        self,
        dev_buffers: Sequence[Sequence[torch.Tensor]],
        host: torch.Tensor,
        dev_rows: torch.Tensor,
        host_offsets: torch.Tensor,
        part_offsets: Sequence[int],
        to_host: bool,
        *,
        token_major: bool = False,
    ) -> None:
        lib = native_build.load()
        if lib is None:
            raise BackendUnavailableError(f"{native_build.error()}; use kernel_backend='torch'")
        self._fn = lib.tkv_copy_blocks
        elt = host.element_size()
        # The arguments, kept: they identify the plan, and keep alive the memory it addresses.
        self._dev_buffers = _frozen(dev_buffers)
        self._host, self._dev_rows, self._host_offsets = host, dev_rows, host_offsets
        self._versions = (dev_rows._version, host_offsets._version)
        self._part_offsets = tuple(part_offsets)
        self._token_major = token_major
        self.layers = len(self._dev_buffers[0])
        self.n = dev_rows.numel()
        self.row_bytes = [bufs[0].numel() // bufs[0].shape[0] * elt for bufs in dev_buffers]
        # Addresses are computed with numpy: torch's intra-op threads made these few
        # elementwise ops 20-30x slower on a loaded 2-core machine (33 ms against 1 ms for the
        # 262k addresses of 32 layers x 4096 tokens), and each torch op costs ~5 us more.
        self._bases = bases_of(self._dev_buffers)
        self._nbytes = np.array(self.row_bytes, dtype=np.int64)
        self._part_bytes = np.array(self._part_offsets, dtype=np.int64) * elt
        self._rows = dev_rows.numpy().astype(np.int64, copy=False)
        self._host_ptr = host.data_ptr()
        self._elt = elt
        self._to_host = to_host
        self._chunk_whole = to_host and token_major
        self._mixed = len(set(self.row_bytes)) > 1
        # Addresses are built on first use: a layer's when that layer is first copied alone.
        self._per_layer: dict[int, tuple] = {}
        self._whole: tuple | None = None

    def built_from(
        self,
        dev_buffers: Sequence[Sequence[torch.Tensor]],
        host: torch.Tensor,
        dev_rows: torch.Tensor,
        host_offsets: torch.Tensor,
        part_offsets: Sequence[int],
        to_host: bool,
        token_major: bool,
    ) -> bool:
        """Whether this plan's addresses are those of these arguments (same objects, index
        tensors unmodified since the plan was built, the host storage where it was)."""
        return (
            dev_rows is self._dev_rows
            and host_offsets is self._host_offsets
            and (dev_rows._version, host_offsets._version) == self._versions
            and host is self._host
            and host.data_ptr() == self._host_ptr
            and to_host == self._to_host
            and token_major == self._token_major
            and tuple(part_offsets) == self._part_offsets
            and _same_buffers(dev_buffers, self._dev_buffers)
        )

    def _addresses(self, layers: slice) -> tuple:
        """(dst, src, sizes) addresses, each shaped (layers, n, parts)."""
        offsets = self._host_offsets.numpy()[layers].astype(np.int64, copy=False)
        hst = (self._host_ptr + offsets * self._elt)[:, :, None] + self._part_bytes
        dev = self._bases[layers][:, None, :] + self._rows[None, :, None] * self._nbytes
        dst, src = (hst, dev) if self._to_host else (dev, hst)
        sizes = np.broadcast_to(self._nbytes, dst.shape) if self._mixed else None
        return dst, src, sizes

    def _layer_major(self, layers: slice) -> tuple:
        dst, src, sizes = self._addresses(layers)
        return _flat(dst), _flat(src), _flat(sizes) if sizes is not None else None

    def run(self, layers: Sequence[int] | None = None) -> None:
        """Copy every layer (``layers`` None, or all of them in order), else each of local
        ``layers`` in turn, one C call per layer."""
        if self.n == 0:
            return
        every = layers is None or (
            len(layers) == self.layers and list(layers) == list(range(self.layers))
        )
        if every:
            if self._whole is None:
                if self._chunk_whole:
                    dst, src, sizes = self._addresses(slice(None))
                    chunked = _chunked(sizes) if sizes is not None else None
                    self._whole = (_chunked(dst), _chunked(src), chunked)
                else:
                    self._whole = self._layer_major(slice(None))
            self._copy(*self._whole, self.layers)
            return
        # A layer's addresses are built when it is first copied (a few numpy ops over one
        # layer's rows): layer 0 of a layer-wise load does not wait for the others'.
        for layer in layers:
            plan = self._per_layer.get(layer)
            if plan is None:
                plan = self._per_layer[layer] = self._layer_major(slice(layer, layer + 1))
            self._copy(*plan, 1)

    def _copy(
        self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray | None, layers: int
    ) -> None:
        total = self.n * layers * sum(self.row_bytes)
        threads = copy_threads(total)  # beside compute: only the cores it leaves free
        rc = self._fn(
            ctypes.c_void_p(dst.ctypes.data),
            ctypes.c_void_p(src.ctypes.data),
            ctypes.c_void_p(sizes.ctypes.data if sizes is not None else 0),
            dst.size,
            self.row_bytes[0],
            threads,
            int(total >= STREAM_MIN_BYTES),
        )
        if rc != 0:
            raise TransferError(
                f"native block copier refused the transfer (rc={rc}): {dst.size} blocks of "
                f"{self.row_bytes} bytes on {threads} threads; it needs a block count >= 0, "
                "block sizes >= 0 and at least 1 thread"
            )


def transfer_rows(
    dev_buffers: Sequence[Sequence[torch.Tensor]],
    host: torch.Tensor,
    dev_rows: torch.Tensor,
    host_offsets: torch.Tensor,
    part_offsets: Sequence[int],
    to_host: bool,
    *,
    layers: Sequence[int] | None = None,
    token_major: bool = False,
    plan_cache: PlanCache | None = None,
) -> None:
    """Copy through a :class:`NativeRowPlan`: the one in ``plan_cache`` when it was built from
    these arguments, else a new one (kept there). One plan per direction per cache."""
    key = ("native", bool(to_host))
    plan = None if plan_cache is None else plan_cache.entries.get(key)
    if not isinstance(plan, NativeRowPlan) or not plan.built_from(
        dev_buffers, host, dev_rows, host_offsets, part_offsets, to_host, token_major
    ):
        args = (dev_buffers, host, dev_rows, host_offsets, part_offsets, to_host)
        plan = NativeRowPlan(*args, token_major=token_major)
        if plan_cache is not None:
            plan_cache.entries[key] = plan
    plan.run(layers)


def copy_blocks(dst: np.ndarray, src: np.ndarray, nbytes: int) -> None:
    """Copy ``nbytes`` from each address ``src[i]`` to ``dst[i]`` (int64 arrays of one length)
    in one C call on the calling thread, the GIL released. No plan, no check of the addresses:
    for callers that computed them from indices they vouch for (``host.layer_rows``). Raises
    BackendUnavailableError where the native copier does not build."""
    lib = native_build.load()
    if lib is None:
        raise BackendUnavailableError(f"{native_build.error()}; use kernel_backend='torch'")
    if dst.size != src.size or dst.dtype != np.int64 or src.dtype != np.int64:
        raise TransferError(
            f"copy_blocks takes two int64 address arrays of one length; got {dst.size} "
            f"{dst.dtype} and {src.size} {src.dtype}"
        )
    dst, src = np.ascontiguousarray(dst), np.ascontiguousarray(src)
    rc = lib.tkv_copy_blocks(
        ctypes.c_void_p(dst.ctypes.data), ctypes.c_void_p(src.ctypes.data), None, dst.size,
        nbytes, 1, 0,
    )  # fmt: skip
    if rc != 0:
        raise TransferError(f"native block copier refused {dst.size} blocks of {nbytes} bytes")
