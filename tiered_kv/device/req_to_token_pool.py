"""ReqToTokenPool: one row per running request; row i column j is the slot of its j-th token."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tiered_kv import platform
from tiered_kv._checks import check_positive_int
from tiered_kv.errors import InvalidArgumentError, OwnershipError


@dataclass
class RequestKV:
    """The KV bookkeeping a request carries between scheduling steps.

    ``req_pool_idx`` is its row (None until one is allocated); ``kv_allocated_len`` counts the
    tokens whose KV slots it holds. A request that holds a row keeps it across prefill chunks."""

    req_pool_idx: int | None = None
    kv_allocated_len: int = 0

    @property
    def holds_kv(self) -> bool:
        return self.req_pool_idx is not None


def _kv_of(req: Any) -> RequestKV:
    kv = getattr(req, "kv", req)
    if not isinstance(kv, RequestKV):
        raise InvalidArgumentError(
            f"request {req!r:.80} has no RequestKV; pass RequestKV objects or objects with .kv"
        )
    return kv


class ReqToTokenPool:
    """Request -> row mapping (the first of the three index mappings).

    - Row 0 is a padding row that is never handed out: padded batches (e.g. CUDA-graph padding)
      default their row index to 0, so their dummy reads and writes land there harmlessly.
    - Free rows are popped from the tail of a list (O(need), no shifting).
    - ``req_generation[row]`` is bumped on every allocation and never reset (not even by
      ``clear``), so an asynchronous reader that stored (row, generation) can tell that the row
      changed owner by comparing generations.
    """

    def __init__(
        self,
        size: int,
        max_context_len: int,
        device: str | torch.device | None = None,
        *,
        on_alloc_rows: Callable[[list[int]], None] | None = None,
    ) -> None:
        self.size = check_positive_int("size", size)
        self.max_context_len = check_positive_int("max_context_len", max_context_len)
        self.device = platform.resolve_device(device)
        self._alloc_size = size + 1
        self.req_to_token = torch.zeros(
            (self._alloc_size, max_context_len), dtype=torch.int32, device=self.device
        )
        self.req_generation = torch.zeros(self._alloc_size, dtype=torch.int64)
        self._on_alloc_rows = on_alloc_rows
        self.clear()

    def clear(self) -> None:
        """Free every row. Generations stay: they must be monotonic for readers to detect reuse."""
        self.free_slots: list[int] = list(range(1, self._alloc_size))
        self._in_use = np.zeros(self._alloc_size, dtype=bool)

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc_rows(self, need_size: int) -> list[int] | None:
        """Take ``need_size`` rows, bump their generation, bind no request. None if short."""
        if isinstance(need_size, bool) or not isinstance(need_size, int) or need_size < 0:
            raise InvalidArgumentError(f"need_size={need_size!r} must be an int >= 0")
        if need_size > len(self.free_slots):
            return None
        if need_size == 0:
            # free_slots[-0:] is the whole list, not an empty one.
            return []
        select_index = self.free_slots[-need_size:]
        del self.free_slots[-need_size:]
        self._in_use[select_index] = True
        self.req_generation[select_index] += 1
        if self._on_alloc_rows is not None:
            self._on_alloc_rows(select_index)
        return select_index

    def alloc(self, reqs: Sequence[Any]) -> list[int] | None:
        """Rows for ``reqs`` (RequestKV objects, or objects with a ``.kv`` RequestKV).

        A request that already holds a row (a chunked prefill continuing) keeps it; it must
        carry allocated KV and its row must be in use, else the scheduler's state is broken and
        this raises. Only the others get new rows. Returns every request's row, or None (and
        binds nothing) when there are not enough free rows."""
        kvs = [_kv_of(r) for r in reqs]
        if len({id(kv) for kv in kvs}) != len(kvs):
            raise InvalidArgumentError("the same request appears twice in one alloc() call")
        reusing = [kv for kv in kvs if kv.holds_kv]
        reused_rows = [kv.req_pool_idx for kv in reusing]
        if len(set(reused_rows)) != len(reused_rows):
            raise OwnershipError(f"two requests claim the same row among {sorted(reused_rows)}")
        for kv in reusing:
            if kv.kv_allocated_len <= 0:
                raise OwnershipError(
                    f"request reuses row {kv.req_pool_idx} but has kv_allocated_len="
                    f"{kv.kv_allocated_len}; a reused row must carry allocated KV"
                )
            idx = kv.req_pool_idx
            if not isinstance(idx, int) or not 1 <= idx <= self.size or not self._in_use[idx]:
                raise OwnershipError(
                    f"request reuses row {idx!r}, which is not an allocated row of this pool"
                )
        select_index = self.alloc_rows(len(kvs) - len(reusing))
        if select_index is None:
            return None
        fresh = iter(select_index)
        for kv in kvs:
            if not kv.holds_kv:
                kv.req_pool_idx = next(fresh)
        return [kv.req_pool_idx for kv in kvs]  # type: ignore[misc]

    def free(self, rows: int | Iterable[int] | torch.Tensor | Any) -> None:
        """Return rows (ints, a tensor, or a request holding one). Freeing row 0, a row out of
        range, a row that is not in use, or the same row twice raises and frees nothing."""
        if isinstance(rows, torch.Tensor):
            idx = [int(x) for x in rows.reshape(-1).tolist()]
        elif isinstance(rows, int) and not isinstance(rows, bool):
            idx = [rows]
        elif isinstance(rows, RequestKV) or hasattr(rows, "kv"):
            kv = _kv_of(rows)
            if kv.req_pool_idx is None:
                raise OwnershipError("request holds no row; nothing to free")
            idx = [kv.req_pool_idx]
        else:
            idx = [int(x) for x in rows]
        if not idx:
            return
        bad = [i for i in idx if not 1 <= i <= self.size]
        if bad:
            raise OwnershipError(
                f"rows {bad[:8]} cannot be freed; valid rows are 1..{self.size} (row 0 is padding)"
            )
        if len(set(idx)) != len(idx):
            raise OwnershipError(f"rows {sorted(idx)[:16]} contain duplicates; each row frees once")
        not_in_use = [i for i in idx if not self._in_use[i]]
        if not_in_use:
            raise OwnershipError(f"rows {not_in_use[:8]} are not allocated (double free?)")
        self._in_use[idx] = False
        self.free_slots.extend(idx)
        if isinstance(rows, RequestKV) or hasattr(rows, "kv"):
            kv = _kv_of(rows)
            kv.req_pool_idx = None
            kv.kv_allocated_len = 0

    def write(self, indices: Any, values: torch.Tensor | int) -> None:
        """``req_to_token[indices] = values`` (e.g. ``(row, slice(a, b))`` and the slots)."""
        self.req_to_token[indices] = values

    def rows_in_use(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(self._in_use)]
