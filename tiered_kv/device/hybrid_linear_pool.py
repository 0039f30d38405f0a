"""HybridLinearKVPool: a hybrid linear model's layers behind one map of global layer ids.

Full-attention layers keep per-token KV in a KV pool (an ``MHATokenToKVPool`` holding just those
layers, densely: its layer ``start_layer + k`` is the k-th full layer); linear-attention (Mamba)
layers keep a per-request state in the request pool's :class:`MambaPool`. Every call here takes
a *global* layer id and is routed to the pool that holds that layer: KV reads and writes of a
full layer go to the KV pool, ``mamba2_layer_cache`` of a linear layer to the state pool, and a
call for the other kind of layer is a LayoutError naming the valid ids.

``host_pool_decls()`` declares the KV pool's buffers only (under this pool, with the global ids
of the full layers): the recurrent state is owned, and declared, by the request pool
(``HybridReqToTokenPool.state_pool_decls``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tiered_kv._checks import same_device
from tiered_kv.device.hybrid_req_pool import HybridReqToTokenPool
from tiered_kv.device.kv_cache import KVCache
from tiered_kv.device.mamba_pool import State, layer_id_list
from tiered_kv.device.pool_decl import HostPoolDecl
from tiered_kv.device.write_loc import KVWriteLoc
from tiered_kv.errors import InvalidArgumentError, LayoutError


class HybridLinearKVPool:
    """Layers ``0 .. len(full_layer_ids) + len(mamba_layer_ids) - 1``, each either full
    attention (in ``full_kv_pool``) or Mamba (in ``req_pool.mamba_pool``), exactly once.

    Geometry (``size``, ``page_size``, ``dtype``, ``device``, ...) is the KV pool's: token
    allocators and host pools see this pool as a KV pool of the full layers."""

    def __init__(
        self,
        full_kv_pool: KVCache,
        req_pool: HybridReqToTokenPool,
        full_layer_ids: Sequence[int],
        mamba_layer_ids: Sequence[int],
    ) -> None:
        if not isinstance(full_kv_pool, KVCache):
            raise InvalidArgumentError(f"full_kv_pool must be a KVCache, got {full_kv_pool!r:.80}")
        if not isinstance(req_pool, HybridReqToTokenPool):
            raise InvalidArgumentError(
                f"req_pool must be a HybridReqToTokenPool, got {type(req_pool).__name__}"
            )
        full = layer_id_list("full_layer_ids", full_layer_ids)
        mamba = layer_id_list("mamba_layer_ids", mamba_layer_ids)
        shared = sorted(set(full) & set(mamba))
        if shared:
            raise InvalidArgumentError(f"layers {shared} are listed as both full and Mamba")
        n = len(full) + len(mamba)
        listed = set(full) | set(mamba)
        if listed != set(range(n)):
            raise InvalidArgumentError(
                f"the full and Mamba layer ids must cover 0..{n - 1} exactly; missing "
                f"{sorted(set(range(n)) - listed)}, beyond it {sorted(listed - set(range(n)))}"
            )
        if full_kv_pool.layer_num != len(full):
            raise InvalidArgumentError(
                f"full_kv_pool holds {full_kv_pool.layer_num} layers for {len(full)} full layers "
                f"{list(full)}; build it with layer_num={len(full)}"
            )
        if tuple(mamba) != req_pool.mamba_pool.mamba_layer_ids:
            raise InvalidArgumentError(
                f"mamba_layer_ids={list(mamba)} differ from the request pool's Mamba pool "
                f"layers {list(req_pool.mamba_pool.mamba_layer_ids)} (same ids, same order)"
            )
        if not same_device(full_kv_pool.device, req_pool.device):
            raise InvalidArgumentError(
                f"full_kv_pool is on {full_kv_pool.device}, req_pool on {req_pool.device}"
            )
        self.full_kv_pool, self.req_to_token_pool = full_kv_pool, req_pool
        self.mamba_pool = req_pool.mamba_pool
        self.full_layer_ids, self.mamba_layer_ids = full, mamba
        self.start_layer, self.layer_num, self.end_layer = 0, n, n - 1
        # {global layer id: id in full_kv_pool} for full layers only.
        self.full_attention_layer_id_mapping = {
            g: full_kv_pool.start_layer + i for i, g in enumerate(full)
        }
        self.size, self.page_size = full_kv_pool.size, full_kv_pool.page_size
        self.dtype, self.store_dtype = full_kv_pool.dtype, full_kv_pool.store_dtype
        self.device = full_kv_pool.device
        self.requires_physical_write_loc = full_kv_pool.requires_physical_write_loc
        self.host_pool_kind = full_kv_pool.host_pool_kind

    # -- layer map ----------------------------------------------------------------------------
    def is_mamba_layer(self, layer_id: int) -> bool:
        self._check_layer(layer_id)
        return layer_id in self.mamba_pool.mamba_map

    def _check_layer(self, layer_id: object) -> None:
        if (
            isinstance(layer_id, bool)
            or not isinstance(layer_id, int)
            or not (0 <= layer_id < self.layer_num)
        ):
            raise InvalidArgumentError(
                f"layer_id={layer_id!r} is not a layer of this model; valid global layer ids "
                f"are 0..{self.end_layer}"
            )

    def _full(self, layer_id: int) -> int:
        """The KV pool's id of full layer ``layer_id``."""
        self._check_layer(layer_id)
        try:
            return self.full_attention_layer_id_mapping[layer_id]
        except KeyError:
            raise LayoutError(
                f"layer {layer_id} is a Mamba layer: it keeps no KV (use mamba2_layer_cache); "
                f"full-attention layers are {list(self.full_layer_ids)}"
            ) from None

    def mamba2_layer_cache(self, layer_id: int) -> State:
        """The recurrent state of Mamba layer ``layer_id`` (views of the state pool)."""
        self._check_layer(layer_id)
        if layer_id not in self.mamba_pool.mamba_map:
            raise LayoutError(
                f"layer {layer_id} is a full-attention layer: it keeps KV, no recurrent state; "
                f"Mamba layers are {list(self.mamba_layer_ids)}"
            )
        return self.mamba_pool.layer_cache(layer_id)

    # -- KV of the full layers ------------------------------------------------------------------
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.full_kv_pool.get_key_buffer(self._full(layer_id))

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.full_kv_pool.get_value_buffer(self._full(layer_id))

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.full_kv_pool.get_kv_buffer(self._full(layer_id))

    def set_kv_buffer(
        self,
        layer_id: int,
        write_loc: KVWriteLoc | torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor | None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
    ) -> None:
        """Write full layer ``layer_id``'s KV (the KV pool validates it; on error nothing is
        written). A Mamba layer is a LayoutError."""
        self.full_kv_pool.set_kv_buffer(
            self._full(layer_id), write_loc, cache_k, cache_v, k_scale, v_scale
        )

    def register_layer_transfer_counter(self, counter) -> None:
        """Layer-wise loads fill the full layers only: ``counter`` counts those, in order, and
        the KV pool waits on it per full layer."""
        self.full_kv_pool.register_layer_transfer_counter(counter)

    @property
    def layer_transfer_counter(self):
        return self.full_kv_pool.layer_transfer_counter

    @property
    def debug_mode(self) -> bool:
        return self.full_kv_pool.debug_mode

    @debug_mode.setter
    def debug_mode(self, on: bool) -> None:
        self.full_kv_pool.debug_mode = bool(on)

    @property
    def num_slots(self) -> int:
        return self.full_kv_pool.num_slots

    def buffers(self) -> list[torch.Tensor]:
        """The KV pool's tensors (the state pool's are the request pool's)."""
        return self.full_kv_pool.buffers()

    def get_kv_size_bytes(self) -> int:
        return self.full_kv_pool.get_kv_size_bytes()

    def bytes_per_token_per_layer(self) -> int:
        return self.full_kv_pool.bytes_per_token_per_layer()

    # -- host tier ------------------------------------------------------------------------------
    def host_pool_decls(self) -> tuple[HostPoolDecl, ...]:
        """The KV pool's declarations only, each re-owned by this pool (the pool allocators
        and transfers see) with the full layers' global ids; parts, dtype and sizes unchanged."""
        start = self.full_kv_pool.start_layer
        return tuple(
            HostPoolDecl(
                name=d.name,
                kind=d.kind,
                device_pool=self,
                parts=d.parts,
                dtype=d.dtype,
                layer_ids=tuple(self.full_layer_ids[i - start] for i in d.layer_ids),
                page_size=d.page_size,
                num_slots=d.num_slots,
            )
            for d in self.full_kv_pool.host_pool_decls()
        )
