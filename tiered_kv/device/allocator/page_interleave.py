"""PageInterleavePoolAllocator: logical-page KV sharding over ``shard_size`` ranks.

N ranks (a context- or tensor-parallel attention group) share one logical slot space N times
one rank's pool; every rank runs the same allocation stream, so every rank's allocator is in
the same state without talking. Logical page l lives on rank ``l % N`` as that rank's local page
``l // N``: slot ``loc`` is owned by ``owner_rank(loc) = (loc // P) % N`` at local row
``local_slot(loc) = (loc // (N * P)) * P + loc % P``. Logical pages 0..N-1 are every rank's
padding page 0 and are never handed out.

Free pages are kept per *class* (class r: the pages of rank r). A request's chain of pages
rotates through the ranks: its page k comes from class ``(base + k) % N``, so a long context is
spread evenly (per-rank page counts differ by at most one). A new chain's base is the class
with the most free pages (the lowest on a tie); a continued chain's next class follows from its
last page. ``available_size()`` is N x P x the *smallest* class's free count: a chain needs every
class, so the tightest rank is the admission gate (``aggregate_free_size()`` counts them all).
A request the classes cannot serve returns None and changes nothing.
"""

from __future__ import annotations

import torch

from tiered_kv import platform
from tiered_kv._checks import check_positive_int
from tiered_kv.device.allocator.capacity import CapacityHooks
from tiered_kv.device.allocator.inputs import (
    check_decode_args,
    check_extend_args,
    check_index,
    outside,
)
from tiered_kv.device.sizing import AllocSizingConfig, resolve_sizing
from tiered_kv.errors import InvalidArgumentError, OwnershipError, StateError


class PageInterleavePoolAllocator(CapacityHooks):
    def __init__(
        self,
        size: int,
        page_size: int,
        shard_size: int,
        device: str | torch.device | None = None,
        need_sort: bool = False,
        *,
        debug_mode: bool | None = None,
        sizing: AllocSizingConfig | None = None,
    ) -> None:
        self.page_size = p = check_positive_int("page_size", page_size)
        self.shard_size = n = check_positive_int("shard_size", shard_size, minimum=2)
        check_positive_int("size", size)
        if size % p:
            raise InvalidArgumentError(f"size={size} (one rank's slots) must be whole pages of {p}")
        self.size_per_rank = size
        self.pages_per_rank = size // p
        self.size = size * n  # logical slots
        self.num_pages = self.pages_per_rank * n + n  # logical pages, the N padding pages included
        self.device = platform.resolve_device(device)
        self.device_index = None if self.device.type != "cuda" else (self.device.index or 0)
        self.need_sort = bool(need_sort)
        self.debug_mode = platform.debug_mode() if debug_mode is None else bool(debug_mode)
        self.sizing = resolve_sizing(sizing, p)
        self.clear()

    # -- state ----------------------------------------------------------------------------------
    def clear(self) -> None:
        n, k = self.shard_size, self.pages_per_rank
        self._free: list[list[int]] = [[j * n + r for j in range(1, k + 1)] for r in range(n)]
        self._released: list[list[int]] = [[] for _ in range(n)]
        self._group: list[torch.Tensor] | None = None

    def class_free_page_counts(self) -> list[int]:
        return [len(f) + len(r) for f, r in zip(self._free, self._released, strict=True)]

    def available_size(self) -> int:
        return self.shard_size * self.page_size * min(self.class_free_page_counts())

    def aggregate_free_size(self) -> int:
        return self.page_size * sum(self.class_free_page_counts())

    def least_full_class(self) -> int:
        counts = self.class_free_page_counts()
        return counts.index(max(counts))

    def get_all_free_pages(self) -> torch.Tensor:
        ids = [x for f in self._free for x in f] + [x for r in self._released for x in r]
        return torch.tensor(ids, dtype=torch.int64)

    def owner_rank(self, loc: torch.Tensor) -> torch.Tensor:
        return (loc // self.page_size) % self.shard_size

    def local_slot(self, loc: torch.Tensor) -> torch.Tensor:
        p, n = self.page_size, self.shard_size
        return (loc // (n * p)) * p + loc % p

    def translate_kv_indices_for_transfer(self, indices: torch.Tensor) -> torch.Tensor:
        """Logical slots as this rank's pool rows (``local_slot``); every rank moves its own."""
        return self.local_slot(indices)

    # -- allocation -------------------------------------------------------------------------------
    def _draws(self, start: int, pages: int) -> list[int]:
        n = self.shard_size
        return [pages // n + (1 if (c - start) % n < pages % n else 0) for c in range(n)]

    def _take(self, plan: list[tuple[int, int]]) -> list[list[int]] | None:
        """Pages for chains ``(start class, pages)``, all or nothing."""
        n = self.shard_size
        counts = self.class_free_page_counts()
        need = [0] * n
        for start, pages in plan:
            for c, k in enumerate(self._draws(start, pages)):
                need[c] += k
        if any(k > have for k, have in zip(need, counts, strict=True)):
            return None
        for c in range(n):
            if need[c] > len(self._free[c]):  # merge the released pages in (sorted if asked)
                merged = self._free[c] + self._released[c]
                self._free[c] = sorted(merged) if self.need_sort else merged
                self._released[c] = []
        out = []
        for start, pages in plan:
            chain = [0] * pages
            for c, k in enumerate(self._draws(start, pages)):
                taken, self._free[c] = self._free[c][:k], self._free[c][k:]
                for i, page in enumerate(taken):
                    chain[(c - start) % n + i * n] = page
            out.append(chain)
        return out

    def _start(self, base: int | None, prefix_pages: int, last: int) -> int:
        n = self.shard_size
        if prefix_pages and last >= 0:
            return (last // self.page_size % n + 1) % n  # the chain continues after its last page
        return (self.least_full_class() if base is None else base + prefix_pages) % n

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        rotation_bases: list[int | None] | None = None,
    ) -> torch.Tensor | None:
        """Slots for tokens ``prefix..seq-1`` of each request; prefixes must be whole pages.
        ``rotation_bases[i]`` is request i's chain base (None: a new chain takes the fullest
        class, and the base chosen is written back on success)."""
        check_extend_args(
            self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens
        )
        p = self.page_size
        pre, seq = prefix_lens_cpu.tolist(), seq_lens_cpu.tolist()
        bases = list(rotation_bases) if rotation_bases is not None else [None] * len(pre)
        if len(bases) != len(pre):
            raise InvalidArgumentError(
                f"rotation_bases has {len(bases)} entries for {len(pre)} requests"
            )
        unaligned = [x for x in pre if x % p]
        if unaligned:
            raise InvalidArgumentError(
                f"prefix lengths {unaligned[:4]} are not whole pages of {p}; an interleaved chain "
                "continues at a page boundary"
            )
        lasts = last_loc.tolist()
        plan, chosen = [], []
        for b, x, s, last in zip(bases, pre, seq, lasts, strict=True):
            start = self._start(b, x // p, last)
            chosen.append((start - x // p) % self.shard_size if b is None else b)
            plan.append((start, -(-s // p) - x // p))
        chains = self._take(plan)
        if chains is None:
            return None
        if rotation_bases is not None:
            rotation_bases[:] = chosen
        slots: list[int] = []
        for chain, x, s in zip(chains, pre, seq, strict=True):
            slots.extend(chain[j // p] * p + j % p for j in range(s - x))
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        """One slot per request: after ``last_loc`` within its page, else the first slot of a
        page of the class after the last page's."""
        check_decode_args(self, seq_lens, seq_lens_cpu, last_loc)
        p = self.page_size
        lens, lasts = seq_lens_cpu.tolist(), last_loc.tolist()
        plan = [
            (self._start(None, (s - 1) // p, last), 1)
            for s, last in zip(lens, lasts, strict=True)
            if (s - 1) % p == 0
        ]
        chains = self._take(plan)
        if chains is None:
            return None
        new = iter(chains)
        out = [
            next(new)[0] * p if (s - 1) % p == 0 else last + 1
            for s, last in zip(lens, lasts, strict=True)
        ]
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """A new chain of ``need_size`` slots (whole pages) from the fullest class on."""
        return self.alloc_cyclic(self.least_full_class(), need_size)

    def alloc_cyclic(self, start_class: int, need_size: int) -> torch.Tensor | None:
        p = self.page_size
        if type(need_size) is not int or need_size < 0 or need_size % p:
            raise InvalidArgumentError(f"need_size={need_size!r} must be whole pages of {p}")
        if type(start_class) is not int or not 0 <= start_class < self.shard_size:
            raise InvalidArgumentError(
                f"start_class={start_class!r} must be 0..{self.shard_size - 1}"
            )
        chains = self._take([(start_class, need_size // p)])
        if chains is None:
            return None
        offsets = torch.arange(p, dtype=torch.int64)
        pages = torch.tensor(chains[0], dtype=torch.int64)
        return (pages[:, None] * p + offsets).reshape(-1).to(self.device)

    # -- freeing ----------------------------------------------------------------------------
    def free(self, free_index: torch.Tensor) -> None:
        """Return the pages holding ``free_index`` to their classes (deferred in a group). A
        slot outside logical pages N..num_pages - 1 (pages 0..N-1 are the ranks' padding) is
        refused in every mode, inside a group too (InvalidArgumentError), changing nothing."""
        check_index("free_index", free_index, self)
        if free_index.numel() == 0:
            return
        p, n = self.page_size, self.shard_size
        bad = outside(free_index, n * p, self.num_pages * p)
        if bad is not None:
            raise InvalidArgumentError(
                f"free_index has values {bad} outside the valid range [{n * p}, "
                f"{self.num_pages * p}): valid slots are {n * p}..{self.num_pages * p - 1} "
                f"(logical pages 0..{n - 1}, slots 0..{n * p - 1}, are the ranks' padding "
                "pages); nothing was changed"
            )
        if self._group is not None:
            self._group.append(free_index.clone())
            return
        self._release(torch.unique(free_index.cpu() // self.page_size).tolist())

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        self.free(free_index)

    def _release(self, pages: list[int]) -> None:
        n = self.shard_size
        if self.debug_mode:
            held = set(self.get_all_free_pages().tolist())
            bad = [q for q in pages if q < n or q >= self.num_pages]
            if bad:
                raise OwnershipError(f"pages {bad[:8]} are padding or outside the pool")
            again = [q for q in pages if q in held]
            if again:
                raise OwnershipError(f"double free: pages {again[:8]} are already free")
        if sum(self.class_free_page_counts()) + len(pages) > self.pages_per_rank * n:
            raise OwnershipError(f"double free: {len(pages)} pages back, fewer were handed out")
        by_class: list[list[int]] = [[] for _ in range(n)]
        for q in pages:
            by_class[q % n].append(q)
        for c in range(n):
            if by_class[c]:
                if self.need_sort:
                    self._released[c] = by_class[c] + self._released[c]
                else:
                    self._free[c] = by_class[c] + self._free[c]

    def free_group_begin(self) -> None:
        if self._group is not None:
            raise StateError("free_group_begin called twice without free_group_end")
        self._group = []

    def free_group_end(self) -> None:
        if self._group is None:
            raise StateError("free_group_end called without free_group_begin")
        group, self._group = self._group, None
        if group:
            self._release(torch.unique(torch.cat(group).cpu() // self.page_size).tolist())
