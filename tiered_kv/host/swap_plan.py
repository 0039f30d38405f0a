"""The bookkeeping of one HiSparse swap-in layer call (``hisparse_swap.HiSparseSwapper``): which
selected positions are resident and where, which miss, which buffer slots are free to take.

``plan`` validates the selection against the layer's position -> buffer index map
(``index_of``: -1 not resident, ``b`` the newest token's reserved slot), stamps every hit's
last use with this call's ``clock`` and returns a :class:`Plan`; on bad input (a position
outside ``[0, n)``, a repeat, more than ``b`` positions besides the newest token) it raises
InvalidArgumentError and leaves ``index_of`` and ``lru`` as they were.

Two implementations, the same answers (tests/host/test_swap_plan.py holds them to each other):

- ``native`` (``kernels/native/swap_plan.c``): one C pass over the selection and one over the
  buffer, through ctypes (~5 us a call for 2,048 positions on this VM);
- ``numpy``: about a dozen numpy passes (~60 us), where no C compiler works.

``auto`` is ``native`` where it builds.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tiered_kv.errors import BackendUnavailableError, InvalidArgumentError
from tiered_kv.kernels import native_build

MODES = ("auto", "native", "numpy")


class Plan(NamedTuple):
    """A call's plan; ``slot_of`` and ``free`` may be the planner's scratch, valid until its
    next call (``missing`` is the caller's)."""

    slot_of: np.ndarray  # per selected position its buffer index (int32; -1 a miss, b newest)
    missing: np.ndarray  # indices into the selection of the misses (int64)
    newest: int  # how often the newest token was selected (0 or 1)
    free: np.ndarray  # buffer indices in [0, b) this call does not use, ascending (int64)


def _repeat() -> InvalidArgumentError:
    return InvalidArgumentError("positions repeat; select each token once")


def _too_many(k: int, b: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{k} positions selected besides the newest token; the device buffer holds {b} "
        "(admit with a larger buffer_size)"
    )


def _out_of_range(sel: np.ndarray, n: int) -> InvalidArgumentError:
    return InvalidArgumentError(f"positions must be in [0, {n}); got {sel.tolist()[:8]}...")


def plan_numpy(sel, n, index_of, lru, b: int, clock: int, ptrs=None) -> Plan:
    """The plan with numpy (see the module doc); ``sel`` int64, ``lru`` b + 1 entries
    (``ptrs``: ignored, the native planner's)."""
    if np.count_nonzero(sel.view(np.uint64) >= n):  # a negative one wraps to > n too
        raise _out_of_range(sel, n)
    slot_of = index_of[sel]
    before = lru.copy()
    lru[slot_of] = clock  # hits (a miss's -1 and the newest's b stamp entry b, never a victim)
    missing = np.flatnonzero(slot_of < 0)
    newest = np.count_nonzero(slot_of == b)
    stamped = np.count_nonzero(lru[:b] == clock)
    bad = stamped != sel.size - missing.size - newest or newest > 1
    if bad or _repeats(index_of, sel[missing]):
        lru[:] = before
        raise _repeat()
    if sel.size - newest > b:
        lru[:] = before
        raise _too_many(sel.size - newest, b)
    return Plan(slot_of, missing, int(newest), np.flatnonzero(lru[:b] != clock))


def _repeats(index_of: np.ndarray, miss: np.ndarray) -> bool:
    """Whether ``miss`` (positions that ``index_of`` maps to -1) holds a position twice: each
    marked with its own index through the map (a repeat's first mark is overwritten), the
    map left as it was."""
    if miss.size < 2:
        return False
    marks = np.arange(-2, -2 - miss.size, -1, dtype=index_of.dtype)
    index_of[miss] = marks
    repeated = np.count_nonzero(index_of[miss] != marks) > 0
    index_of[miss] = -1
    return repeated


class NativePlanner:
    """``plan`` in one C call, with its scratch kept (one per swapper: not thread-safe)."""

    def __init__(self, b: int) -> None:
        lib = native_build.load_swap_plan()
        if lib is None:
            raise BackendUnavailableError(native_build.swap_plan_error())
        self._fn = lib.tkv_swap_plan
        self.b = b
        self._slot_of = np.empty(b + 1, dtype=np.int32)
        self._missing = np.empty(b + 1, dtype=np.int64)
        self._free = np.empty(b, dtype=np.int64)
        self._counts = np.zeros(3, dtype=np.int64)
        self._ptrs = [a.ctypes.data for a in (self._slot_of, self._missing, self._free)]
        self._counts_ptr = self._counts.ctypes.data

    def __call__(self, sel, n, index_of, lru, b: int, clock: int, ptrs=None) -> Plan:
        """``ptrs``: the addresses of ``sel``, ``index_of`` and ``lru`` where the caller has
        them (numpy's ``.ctypes`` costs about a microsecond each)."""
        k = sel.size
        if k > b + 1:  # the scratch holds b + 1: more is an error either way, numpy's
            return plan_numpy(sel, n, index_of, lru, b, clock)
        if ptrs is None:
            ptrs = (sel.ctypes.data, index_of.ctypes.data, lru.ctypes.data)
        slot_of, missing, free = self._ptrs
        rc = self._fn(
            ptrs[0], k, n, ptrs[1], ptrs[2], b, clock, slot_of, missing, free, self._counts_ptr
        )
        if rc == 1:
            raise _out_of_range(sel, n)
        if rc == 2:
            raise _repeat()
        if rc:
            raise _too_many(k - int(self._counts[1]), b)
        m, newest, f = self._counts.tolist()
        return Plan(self._slot_of[:k], self._missing[:m].copy(), newest, self._free[:f])


def planner(mode: str, b: int):
    """The plan function for ``mode`` (``MODES``) and a buffer of ``b`` slots."""
    if mode not in MODES:
        raise InvalidArgumentError(f"plan_mode={mode!r}; use one of {MODES}")
    if mode == "numpy":
        return plan_numpy
    if mode == "native":
        return NativePlanner(b)
    try:
        return NativePlanner(b)
    except BackendUnavailableError:
        return plan_numpy
