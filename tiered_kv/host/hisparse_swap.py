"""HiSparseSwapper: one request's swap-in of the tokens its sparse layers select.

A sparse-attention request keeps every token's KV - every declared part: the MLA latent and,
for DSA, the indexer key - in the host pool at its host slots, and holds on the device only a
fixed buffer of ``buffer_size`` slots (``alloc_device_buffer``) plus one reserved page for the
newest token. Each decode step, per layer, the indexer's top-k picks token positions;
``swap_in`` makes exactly those resident in that layer's buffer, copies from host only the ones
that are not (hits vs loaded), and reuses the slots of tokens no longer selected (least
recently used first) when no slot is free.

Residency is per layer: each layer's indexer selects its own tokens, so buffer slot ``j``
holds different tokens in different layers. The allocator's ``logical_to_device`` table,
which has one device slot per token, cannot say that: a swap-in does not go through it (nor
through the host pool's general ``load_to_device_per_layer``, whose translation, validation
and plan building cost ~1 ms per layer call). Its copy goes straight from the tokens' host
slots (each written by a validated backup, in ``admit`` or ``commit_token``) into physical
slots of the request's own buffer, one :class:`LayerRowLoader` call per layer. The
bookkeeping: per layer a position -> buffer slot map kept with the residency (the pending
newest token at the reserved index in every layer), and per call one plan
(:mod:`~tiered_kv.host.swap_plan`: one native call, or numpy) that validates the selection,
stamps the hits and lists the misses and the free slots. Only the newest token has a table
entry (the reserved slot, written by the model) until ``commit_token`` has backed it up.

A slot is marked as holding a token only after that token's copy returned: a copy that
raises leaves every token of it non-resident - a counted miss reported in ``SwapIn.failed``,
with device slot 0 (the padding sink), never another token's bytes. The tokens that the slots
held before were already dropped.

Scoring reads the indexer keys of every token from the device (``HiSparseIndexKeys``: they
are ~10% of the latent's bytes, and reading them from host every step would move every
earlier token's keys over the host link per layer); their host copy is kept for the other
tiers (eviction, storage), not for scoring.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from tiered_kv._checks import check_index_tensor, check_positive_int
from tiered_kv.device.allocator.hisparse import HiSparseTokenToKVPoolAllocator
from tiered_kv.device.dsa_pool import dequantize_index_k
from tiered_kv.device.hisparse_index import HiSparseIndexKeys
from tiered_kv.device.mla_pool import MLATokenToKVPool
from tiered_kv.errors import InvalidArgumentError, StateError
from tiered_kv.host.host_kv_cache import HostKVCache
from tiered_kv.host.layer_rows import MODES, LayerRowLoader
from tiered_kv.host.pool_group import HostPoolGroup
from tiered_kv.host.swap_plan import MODES as PLAN_MODES
from tiered_kv.host.swap_plan import planner

_CPU = torch.device("cpu")
_NONE = torch.empty(0, dtype=torch.int64)  # SwapIn.failed when nothing failed
_NO_ROWS = np.empty(0, dtype=np.int64)  # SwapIn.copied when nothing was copied
HostPool = HostPoolGroup | HostKVCache  # DSA: the latent and indexer members; MLA: one pool


class SwapIn(NamedTuple):
    device_slots: torch.Tensor  # per selected position: its device slot, 0 where it failed
    hits: int  # already resident (the newest token included)
    loaded: int  # copied in from host now
    failed: torch.Tensor  # positions whose copy failed: non-resident, read nothing for them
    copied: np.ndarray = _NO_ROWS  # indices into the selection copied now


class HiSparseSwapper:
    """The swap-in path of one admitted request (build it with :meth:`admit`)."""

    def __init__(
        self,
        allocator: HiSparseTokenToKVPoolAllocator,
        pool: MLATokenToKVPool,
        host: HostPool,
        index_keys: HiSparseIndexKeys | None,
        logical: torch.Tensor,
        host_slots: torch.Tensor,
        buffer: torch.Tensor,
        kept: int,
        copy_mode: str = "auto",
        plan_mode: str = "auto",
    ) -> None:
        """Use :meth:`admit`: it validates, stages and takes the buffer."""
        self.allocator = allocator
        self.pool, self.host, self.index_keys = pool, host, index_keys
        self._latent = _latent_member(host)
        self._rows = LayerRowLoader(self._latent, copy_mode)
        self.logical, self.host_slots = logical, host_slots  # by position, CPU int64
        self._host_np = host_slots.numpy()  # shares memory with host_slots
        self.buffer = buffer  # device slots: buffer_size swap slots, then the reserved page
        self.buffer_size = buffer.numel() - allocator.page_size
        self._plan = planner(plan_mode, self.buffer_size)  # swap_plan: native or numpy
        self.reserved = buffer[self.buffer_size :][:1]  # the newest token's device slot
        ids = buffer.to(_CPU, torch.int64).numpy()
        b = self.buffer_size
        # By buffer index: the swap slots' device slots, the reserved one (index b: the newest
        # token's), then 0 (index -1: a failed token's, the padding sink)
        self._slot_ids = np.append(ids[: b + 1], 0)
        layers = pool.layer_num
        # Per layer, position -> buffer index (-1: not resident; b: the newest token), kept
        # with the residency; grown by begin_token.
        self._slot_of = np.full((layers, max(16, 2 * logical.numel())), -1, dtype=np.int32)
        self._slot_of[:, :kept] = np.arange(kept, dtype=np.int32)
        self.token_in = torch.full((layers, b), -1, dtype=torch.int64)
        self.token_in[:, :kept] = torch.arange(kept)  # prefill rows kept in place, all layers
        # Last use per buffer index, plus a column (b) that the newest token's and a miss's
        # -1 stamp, never a victim
        self._last_used = np.full((layers, b + 1), -1, dtype=np.int64)
        self._map_at = self._slot_of.ctypes.data  # addresses for the native planner
        self._lru_at = [self._last_used.ctypes.data + i * (b + 1) * 8 for i in range(layers)]
        self.last_used = torch.from_numpy(self._last_used[:, :b])
        self._token_in = self.token_in.numpy()
        self.newest: int | None = None
        self.clock = 0
        self.num_hits = self.num_loaded = self.num_failed = 0
        self.last_error: BaseException | None = None
        self.released = False

    @classmethod
    def admit(
        cls,
        allocator: HiSparseTokenToKVPoolAllocator,
        pool: MLATokenToKVPool,
        host: HostPool,
        index_keys: HiSparseIndexKeys | None,
        logical: torch.Tensor,
        host_slots: torch.Tensor,
        buffer_size: int,
        *,
        copy_mode: str = "auto",
        plan_mode: str = "auto",
        backed_up: int = 0,
    ) -> HiSparseSwapper | None:
        """After a prefill wrote the request's tokens at their device slots (``logical``,
        each with a device slot): back every part up to ``host_slots``, copy the indexer
        rows into ``index_keys``, and turn the device slots into a buffer of ``buffer_size``
        slots (a multiple of the page size) plus a reserved page. The first prefill tokens
        stay resident where their slots were kept. ``copy_mode`` is how swap-in copies
        (:class:`LayerRowLoader`: ``auto``, ``blocks``, ``numpy``, ``kernel``), ``plan_mode``
        how it keeps its books (``swap_plan``: ``auto``, ``native``, ``numpy``). Returns None,
        with the device slots untouched (their host copy made), when the device cannot hold
        the buffer. ``backed_up``: the first tokens whose host slots already hold them (a
        prefix restored from the tree): not backed up again. Raises InvalidArgumentError /
        StateError on bad input before changing anything."""
        p = allocator.page_size
        check_positive_int("buffer_size", buffer_size)
        if buffer_size % p:
            raise InvalidArgumentError(
                f"buffer_size={buffer_size} must be a multiple of page_size={p}"
            )
        if pool is not allocator.get_kvcache():
            raise InvalidArgumentError("pool is not the allocator's device pool")
        check_index_tensor("logical", logical, allocator.device)
        check_index_tensor("host_slots", host_slots, _CPU)
        if logical.numel() != host_slots.numel() or logical.numel() == 0:
            raise InvalidArgumentError(
                f"logical has {logical.numel()} slots and host_slots {host_slots.numel()}; "
                "give every token of the request one of each (at least one token)"
            )
        _latent_member(host)  # raises when the host pool holds no latent
        if copy_mode not in MODES:
            raise InvalidArgumentError(f"copy_mode={copy_mode!r}; use one of {MODES}")
        if plan_mode not in PLAN_MODES:
            raise InvalidArgumentError(f"plan_mode={plan_mode!r}; use one of {PLAN_MODES}")
        if type(backed_up) is not int or not 0 <= backed_up < logical.numel():
            raise InvalidArgumentError(
                f"backed_up={backed_up!r} must be an int in [0, {logical.numel()})"
            )
        dev = allocator.translate_kv_indices_for_transfer(logical)  # raises: no device slot
        host.backup_from_device_all_layer(pool, host_slots[backed_up:], logical[backed_up:])
        if index_keys is not None:
            index_keys.copy_from_device(logical, dev)
        buffer = allocator.alloc_device_buffer(logical, buffer_size + p)
        if buffer is None:
            return None
        kept = min(buffer_size, logical.numel())
        return cls(
            allocator, pool, host, index_keys, logical.to(_CPU, torch.int64),
            host_slots.to(torch.int64).contiguous(), buffer, kept, copy_mode, plan_mode,
        )  # fmt: skip

    # -- the newest token -----------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return self.logical.numel()

    def begin_token(self, logical: torch.Tensor, host_slot: torch.Tensor) -> torch.Tensor:
        """A decode token (its logical slot from ``alloc_decode``, its host slot): it gets the
        reserved device slot, returned, where the model writes its latent and indexer key;
        it is resident in every layer until :meth:`commit_token`. Mutates the table entry."""
        self._live()
        if self.newest is not None:
            raise StateError("the previous token is not committed; call commit_token first")
        check_index_tensor("logical", logical, self.allocator.device)
        check_index_tensor("host_slot", host_slot, _CPU)
        if logical.numel() != 1 or host_slot.numel() != 1:
            raise InvalidArgumentError("begin_token takes one logical slot and one host slot")
        if bool(torch.isin(logical.to(_CPU, torch.int64), self.logical).any()):
            raise InvalidArgumentError(f"logical slot {logical.tolist()} is already a token here")
        if bool((self.allocator.translate_loc(logical.to(torch.int64)) != 0).any()):
            raise StateError(f"logical slot {logical.tolist()} already has a device slot")
        slot = self.reserved
        self.allocator.logical_to_device[logical.to(torch.int64)] = slot
        self.logical = torch.cat([self.logical, logical.to(_CPU, torch.int64)])
        self.host_slots = torch.cat([self.host_slots, host_slot.to(torch.int64)])
        self._host_np = self.host_slots.numpy()
        if self.num_tokens > self._slot_of.shape[1]:
            grown = np.full((self._slot_of.shape[0], 2 * self.num_tokens), -1, dtype=np.int32)
            grown[:, : self._slot_of.shape[1]] = self._slot_of
            self._slot_of = grown
            self._map_at = grown.ctypes.data
        self.newest = self.num_tokens - 1
        self._slot_of[:, self.newest] = self.buffer_size  # the reserved slot, every layer
        return slot

    def commit_token(self) -> None:
        """Back the newest token's every part up to its host slot and its indexer row into
        ``index_keys``; then it is a host token like the others and its table entry is
        cleared. A failed backup raises and leaves the token pending (call again)."""
        self._live()
        if self.newest is None:
            raise StateError("no token to commit; call begin_token first")
        lg = self.logical[-1:].to(self.allocator.device)
        self.host.backup_from_device_all_layer(self.pool, self.host_slots[-1:], lg)
        if self.index_keys is not None:
            self.index_keys.copy_from_device(lg, self.reserved)
        self.allocator.logical_to_device[lg] = 0
        self._slot_of[:, self.newest] = -1  # a host token now: resident nowhere
        self.newest = None

    # -- scoring and swap-in --------------------------------------------------------------------
    def score_keys(self, layer_id: int) -> torch.Tensor:
        """Dequantized indexer keys of every token of the request in ``layer_id``, by position
        (the newest one from its device slot): what the indexer scores."""
        self._live()
        if self.index_keys is None:
            raise StateError("this swapper was admitted without index_keys")
        n = self.num_tokens - (self.newest is not None)
        keys = self.index_keys.get_index_k(layer_id, self.logical[:n].to(self.pool.device))
        if self.newest is None:
            return keys
        # Its row as stored, not through the pool's getter: that waits on (and raises the
        # error of) the last dense forward's layer-wise load, which this token never had
        row = self.pool.index_k_with_scale_buffer[self.pool.layer_index(layer_id)][self.reserved]
        return torch.cat([keys, dequantize_index_k(row, self.pool.index_head_dim)])

    def swap_in(self, layer_id: int, positions: torch.Tensor) -> SwapIn:
        """Make the tokens at ``positions`` (unique, CPU int, at most ``buffer_size`` besides
        the newest token) resident in layer ``layer_id`` and return their device slots.
        Mutates that layer's residency and buffer rows only. A failed copy is a counted miss
        (``SwapIn.failed``); bad input raises InvalidArgumentError and changes nothing.

        The bookkeeping is a few numpy passes over the selection: each position's buffer
        index comes from the layer's position -> index map, the hits are stamped with this
        call's clock (which also finds repeats: two equal positions stamp one index), and
        only a miss touches anything else."""
        self._live()
        local = self.pool.layer_index(layer_id)
        check_index_tensor("positions", positions, _CPU)
        sel = np.ascontiguousarray(positions.numpy(), dtype=np.int64)
        index_of, lru = self._slot_of[local], self._last_used[local]
        clock = self.clock + 1
        same = positions.dtype == torch.int64 and positions.is_contiguous()  # sel is its memory
        at = positions.data_ptr() if same else sel.ctypes.data
        ptrs = (at, self._map_at + local * self._slot_of.strides[0], self._lru_at[local])
        plan = self._plan(sel, self.num_tokens, index_of, lru, self.buffer_size, clock, ptrs)
        slot_of, missing = plan.slot_of, plan.missing
        miss = sel[missing]
        k = sel.size
        self.clock = clock
        ok = True
        if miss.size:
            free = plan.free  # empty or unselected: oldest first
            victims = free[np.argsort(lru[free], kind="stable")[: miss.size]]
            held = self._token_in[local]
            gone = held[victims]
            index_of[gone[gone >= 0]] = -1  # their old tokens are gone whatever the copy does
            held[victims] = -1
            ok = self._load(layer_id, miss, victims)
            if ok:
                held[victims] = miss
                index_of[miss] = victims
                slot_of[missing] = victims
                lru[victims] = clock
            else:
                lru[victims] = -1
        slots = self._slot_ids[slot_of]  # a failed token's -1 reads the trailing 0
        hits = k - missing.size
        loaded = missing.size if ok else 0
        failed = _NONE if ok else torch.from_numpy(miss)
        copied = missing if ok and miss.size else _NO_ROWS
        self.num_hits += hits
        self.num_loaded += loaded
        self.num_failed += failed.numel()
        slots_t = torch.from_numpy(slots)  # int64
        if self.buffer.device.type != "cpu":
            slots_t = slots_t.to(self.buffer.device)
        return SwapIn(slots_t, hits, loaded, failed, copied)

    def _load(self, layer_id: int, positions: np.ndarray, slots: np.ndarray) -> bool:
        """Copy layer ``layer_id`` of ``positions`` from host into buffer ``slots`` (indices
        into the buffer); False (the error kept in ``last_error``) when the copy raised."""
        try:
            self._rows.load(layer_id, self._host_np[positions], self._slot_ids[slots])
        except Exception as e:  # a failed transfer is a counted miss, not a crash
            self.last_error = e
            return False
        return True

    def resident(self, layer_id: int) -> torch.Tensor:
        """Positions resident in layer ``layer_id``'s buffer, by buffer slot (-1: empty)."""
        return self.token_in[self.pool.layer_index(layer_id)].clone()

    # -- release --------------------------------------------------------------------------------
    def release(self) -> None:
        """Give the buffer back (and the newest token's table entry). The caller still owns
        and frees the logical and host slots. Later calls raise StateError."""
        self._live()
        if self.newest is not None:
            self.allocator.logical_to_device[self.logical[-1:].to(self.allocator.device)] = 0
        self.allocator.free_device_slots(self.buffer)
        self.released = True

    def _live(self) -> None:
        if self.released:
            raise StateError("this request's swapper was released")


def _latent_member(host: HostPool) -> HostKVCache:
    """The host pool holding the latent: the group's ``kv`` member, or the pool itself."""
    for m in getattr(host, "members", (host,)):
        if m.decl.name == "kv":
            return m
    raise InvalidArgumentError("the host pool holds no 'kv' (latent) declaration")
