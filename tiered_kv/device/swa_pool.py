"""SWAKVPool: a hybrid model's KV as a full-attention sub-pool and a sliding-window sub-pool.

Each global layer id maps to (sub-pool, local id); full layers write at ``KVWriteLoc.loc`` (or
``full_loc``), window layers at ``KVWriteLoc.swa_loc``, which the caller resolves once per
forward (``SWATokenToKVPoolAllocator.translate_loc_from_full_to_swa``, or ``ring_loc`` in ring
mode): the pool never translates a write itself. Both sub-pools have their own size and their
own padding page 0.

With ``swa_req_ring_size`` the window KV is a per-request ring instead of a paged pool: request
row r (rows start at 1, row 0 is the request table's padding row) owns the ``ring_cost`` slots
from ``page_size + (r - 1) * ring_cost``, and position i of its sequence lives at ring slot
``i mod ring_size`` (``ring_cost`` is the ring rounded up to whole pages). The window sub-pool then
holds exactly ``rows * ring_cost`` usable slots.

``host_pool_decls()`` declares both sub-pools (``full`` and ``swa``), each with its global layer
ids, so nothing outside the pool guesses which layer lives where.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tiered_kv._checks import check_index_tensor, check_positive_int
from tiered_kv.device.mha_pool import MHATokenToKVPool
from tiered_kv.device.pool_decl import HostPoolDecl
from tiered_kv.device.write_loc import KVWriteLoc, as_write_loc
from tiered_kv.errors import InvalidArgumentError


def ring_cost_for(ring_size: int, page_size: int) -> int:
    """Slots one request's ring takes: ``ring_size`` rounded up to whole pages."""
    return -(-ring_size // page_size) * page_size


def _layer_ids(name: str, ids) -> tuple[int, ...]:
    try:
        out = tuple(ids)
    except TypeError:
        raise InvalidArgumentError(f"{name} must be a sequence of layer ids, got {ids!r}") from None
    bad = [i for i in out if isinstance(i, bool) or not isinstance(i, int) or i < 0]
    if bad or not out:
        raise InvalidArgumentError(
            f"{name}={list(out)!r} must be a non-empty list of ints >= 0 (a model with no "
            "layers of one kind uses MHATokenToKVPool)"
        )
    if len(set(out)) != len(out):
        raise InvalidArgumentError(f"{name}={list(out)!r} lists a layer twice")
    return out


class SWAKVPool:
    """Full-attention layers on one MHA pool of ``size`` slots, window layers on another of
    ``size_swa`` slots (``swa_head_num``/``swa_head_dim`` when they differ)."""

    requires_physical_write_loc = False
    host_pool_kind = "mha"

    def __init__(
        self,
        size: int,
        size_swa: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        full_attention_layer_ids: Sequence[int],
        swa_attention_layer_ids: Sequence[int],
        device: str | torch.device | None = None,
        *,
        v_head_dim: int | None = None,
        swa_head_num: int | None = None,
        swa_head_dim: int | None = None,
        swa_req_ring_size: int | None = None,
    ) -> None:
        full = _layer_ids("full_attention_layer_ids", full_attention_layer_ids)
        swa = _layer_ids("swa_attention_layer_ids", swa_attention_layer_ids)
        both = sorted((*full, *swa))
        if len(set(both)) != len(both):
            shared = sorted(set(full) & set(swa))
            raise InvalidArgumentError(f"layers {shared} are listed as both full and window")
        start = both[0]
        if both != list(range(start, start + len(both))):
            raise InvalidArgumentError(
                f"the full and window layer ids together must be one range of layers "
                f"(this rank's), got {both}"
            )
        self.page_size = check_positive_int("page_size", page_size)
        self.swa_req_ring_size = (
            None
            if swa_req_ring_size is None
            else check_positive_int("swa_req_ring_size", swa_req_ring_size)
        )
        self.full_kv_pool, self.swa_kv_pool = self._new_sub_pools(
            (size, size_swa), page_size, dtype, (len(full), len(swa)), device,
            full_heads=(head_num, head_dim, v_head_dim),
            swa_heads=(
                head_num if swa_head_num is None else swa_head_num,
                head_dim if swa_head_dim is None else swa_head_dim,
                v_head_dim if swa_head_dim is None else None,
            ),
        )  # fmt: skip
        if self.swa_req_ring_size is not None and size_swa % self.ring_cost:
            raise InvalidArgumentError(
                f"size_swa={size_swa} must be request rows x ring cost {self.ring_cost} "
                f"(swa_req_ring_size={self.swa_req_ring_size} rounded up to pages of {page_size})"
            )
        self.size, self.size_swa = self.full_kv_pool.size, self.swa_kv_pool.size
        self.dtype, self.store_dtype = dtype, self.full_kv_pool.store_dtype
        self.device = self.full_kv_pool.device
        self.full_layer_ids, self.swa_layer_ids = full, swa
        self.start_layer, self.layer_num = start, len(both)
        self.end_layer = start + len(both) - 1
        # {global layer id: (local id, is a window layer)}
        self.layers_mapping: dict[int, tuple[int, bool]] = {
            **{g: (i, False) for i, g in enumerate(full)},
            **{g: (i, True) for i, g in enumerate(swa)},
        }
        self.full_to_swa_index_mapping: torch.Tensor | None = None
        self.layer_transfer_counter = None

    def _new_sub_pools(
        self,
        sizes: tuple[int, int],
        page_size: int,
        dtype: torch.dtype,
        layer_nums: tuple[int, int],
        device: str | torch.device | None,
        *,
        full_heads: tuple[int, int, int | None],
        swa_heads: tuple[int, int, int | None],
    ) -> tuple[MHATokenToKVPool, MHATokenToKVPool]:
        """The full and window sub-pools, each with buffers of its own (a subclass may have
        them share one buffer). ``*_heads``: (head_num, head_dim, v_head_dim)."""
        return tuple(
            MHATokenToKVPool(size, page_size, dtype, h, d, n, device, v_head_dim=dv)
            for size, n, (h, d, dv) in zip(sizes, layer_nums, (full_heads, swa_heads), strict=True)
        )

    # -- geometry ---------------------------------------------------------------------------
    @property
    def ring_cost(self) -> int:
        if self.swa_req_ring_size is None:
            raise InvalidArgumentError("this SWAKVPool has no per-request ring")
        return ring_cost_for(self.swa_req_ring_size, self.page_size)

    @property
    def ring_rows(self) -> int:
        """Request rows the ring sub-pool holds (rows 1..ring_rows)."""
        return self.size_swa // self.ring_cost

    @property
    def debug_mode(self) -> bool:
        return self.full_kv_pool.debug_mode

    @debug_mode.setter
    def debug_mode(self, on: bool) -> None:
        self.full_kv_pool.debug_mode = self.swa_kv_pool.debug_mode = bool(on)

    def sub_pool(self, layer_id: int) -> tuple[MHATokenToKVPool, int, bool]:
        """(sub-pool, local id, is a window layer) of global ``layer_id``."""
        try:
            local, is_swa = self.layers_mapping[layer_id]
        except (KeyError, TypeError):
            raise InvalidArgumentError(
                f"layer_id={layer_id!r} is not held by this pool; valid global layer ids are "
                f"{self.start_layer}..{self.end_layer}"
            ) from None
        return (self.swa_kv_pool if is_swa else self.full_kv_pool), local, is_swa

    def buffers(self) -> list[torch.Tensor]:
        return [*self.full_kv_pool.buffers(), *self.swa_kv_pool.buffers()]

    def get_kv_size_bytes(self) -> int:
        return self.full_kv_pool.get_kv_size_bytes() + self.swa_kv_pool.get_kv_size_bytes()

    # -- index spaces -----------------------------------------------------------------------
    def register_mapping(self, full_to_swa_index_mapping: torch.Tensor) -> None:
        """The allocator's full -> window slot table (``size + page_size + 1`` entries, the last
        a -1 sentinel), read by ``translate_loc_from_full_to_swa``."""
        want = self.size + self.page_size + 1
        if full_to_swa_index_mapping.shape != (want,):
            raise InvalidArgumentError(
                f"full_to_swa_index_mapping has shape {tuple(full_to_swa_index_mapping.shape)}; "
                f"this pool needs ({want},): size + page_size + 1 (the -1 sentinel)"
            )
        self.full_to_swa_index_mapping = full_to_swa_index_mapping

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        """Window slots of full slots ``kv_indices``; -1 (no prefix) maps to -1 and a full slot
        whose window peer was freed to 0 (the padding slot)."""
        if self.swa_req_ring_size is not None:
            raise InvalidArgumentError(
                "a per-request ring has no full -> window table; window slots come from "
                "ring_loc(rows, positions)"
            )
        if self.full_to_swa_index_mapping is None:
            raise InvalidArgumentError("no full -> window mapping registered (build the allocator)")
        return self.full_to_swa_index_mapping[kv_indices]

    def ring_loc(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Window slots of sequence ``positions`` of request ``rows`` (one row per position)."""
        cost = self.ring_cost
        check_index_tensor("rows", rows, None)
        check_index_tensor("positions", positions, None)
        if rows.shape != positions.shape:
            raise InvalidArgumentError(
                f"rows has {rows.shape[0]} entries and positions {positions.shape[0]}; one row "
                "per position"
            )
        if rows.numel() and (int(rows.min()) < 1 or int(rows.max()) > self.ring_rows):
            raise InvalidArgumentError(
                f"rows {rows.tolist()[:8]} must be request rows 1..{self.ring_rows}"
            )
        if positions.numel() and int(positions.min()) < 0:
            raise InvalidArgumentError("positions must be >= 0")
        rows, positions = rows.to(torch.int64), positions.to(torch.int64)
        return self.page_size + (rows - 1) * cost + positions % self.swa_req_ring_size

    # -- layer-wise loading -------------------------------------------------------------------
    def register_layer_transfer_counter(self, counter) -> None:
        """Waits happen here, per global layer; the sub-pools never wait themselves."""
        if counter is not None and counter.num_layers != self.layer_num:
            raise InvalidArgumentError(
                f"layer transfer counter counts {counter.num_layers} layers; this pool holds "
                f"{self.layer_num}"
            )
        self.layer_transfer_counter = counter

    def _ready(self, layer_id: int) -> tuple[MHATokenToKVPool, int, bool]:
        target = self.sub_pool(layer_id)
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id - self.start_layer)
        return target

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        pool, local, _ = self._ready(layer_id)
        return pool.get_key_buffer(local)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        pool, local, _ = self._ready(layer_id)
        return pool.get_value_buffer(local)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool, local, _ = self._ready(layer_id)
        return pool.get_key_buffer(local), pool.get_value_buffer(local)

    # -- writes -------------------------------------------------------------------------------
    def set_kv_buffer(
        self,
        layer_id: int,
        write_loc: KVWriteLoc | torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor | None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
    ) -> None:
        """Write layer ``layer_id``: a full layer at ``loc`` (``full_loc`` when given), a window
        layer at ``swa_loc``, which must be set (a bare tensor is a full-pool loc only)."""
        pool, local, is_swa = self.sub_pool(layer_id)
        loc_info = as_write_loc(write_loc)
        if is_swa:
            if loc_info.swa_loc is None:
                raise InvalidArgumentError(
                    f"layer {layer_id} is a window layer: pass KVWriteLoc(loc, swa_loc=...) with "
                    "the window slots (translate_loc_from_full_to_swa or ring_loc of loc)"
                )
            target = KVWriteLoc(loc_info.swa_loc, physical=loc_info.physical)
        else:
            target = KVWriteLoc(loc_info.target_full_loc, physical=loc_info.physical)
        pool.set_kv_buffer(local, target, cache_k, cache_v, k_scale, v_scale)

    # -- host tier ------------------------------------------------------------------------------
    def host_pool_decls(self) -> tuple[HostPoolDecl, ...]:
        """Both sub-pools, each under its own name with its global layer ids."""
        out = []
        for name, pool, ids in (
            ("full", self.full_kv_pool, self.full_layer_ids),
            ("swa", self.swa_kv_pool, self.swa_layer_ids),
        ):
            (decl,) = pool.host_pool_decls()
            out.append(
                HostPoolDecl(
                    name=name,
                    kind=decl.kind,
                    device_pool=pool,
                    parts=decl.parts,
                    dtype=decl.dtype,
                    layer_ids=ids,
                    page_size=decl.page_size,
                    num_slots=decl.num_slots,
                )
            )
        return tuple(out)
