"""SGLang's own HiCache stack on CPU, driven as its radix cache drives it.

``SGLangRig`` builds SGLang 0.5.23's device KV pool (MHA or MLA), its paged allocator, its host
pool in one layout and its ``HiCacheController`` with a storage backend (SGLang's ``file``
backend, or a ``dynamic`` one by module path, e.g. ours), for one tensor-parallel rank. The
calls are those of SGLang's ``UnifiedRadixCache`` on the scheduler thread: ``write`` + the
write ack (device -> host), ``write_storage`` + the backup ack (host -> storage, SGLang's backup
thread), ``prefetch`` + the hit query + allocating the host pages + the prefetch acks (storage ->
host, its prefetch threads), ``load`` + ``start_loading`` (host -> device).

What is not SGLang's own on a CPU-only machine: its host pools bind their copy ops only under
CUDA / ROCm, so the caller installs the torch stand-ins of ``tools/sglang_peer/stubs``
(``peer_kvcacheio_cpu.install()``; the rig registers the device buffers the pointer-table ops
resolve). SGLang's io backend ``direct`` copies layer_first and page_first_direct pools and
``kernel`` page_first ones (its ``move_indices``), so the rig picks the io backend by layout.
There is no process group: ``tp_group=None`` (the rank-sync all-reduces are skipped) and the
rank is set with SGLang's ``get_parallel().override`` while the controller attaches.
"""

from __future__ import annotations

import importlib
import threading
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from queue import Empty

import torch

from tiered_kv.errors import StateError

IO_BACKENDS = {"layer_first": "direct", "page_first_direct": "direct", "page_first": "kernel"}
ACK_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RigShape:
    """The model geometry: MHA (heads x head_dim, K and V) or MLA (one latent row of
    kv_lora_rank + rope_dim)."""

    mla: bool
    layout: str
    page_size: int = 16
    layers: int = 4
    heads: int = 2  # MHA
    head_dim: int = 64  # MHA
    kv_lora_rank: int = 96  # MLA
    rope_dim: int = 32  # MLA
    device_tokens: int = 4096
    host_ratio: float = 2.0
    dtype: torch.dtype = torch.bfloat16


def dynamic_extra_config(module_path: str, class_name: str, **ours: object) -> dict:
    """The extra config of a backend SGLang loads by module path (v1 interface)."""
    base = {"backend_name": class_name, "module_path": module_path, "class_name": class_name}
    return {**base, "interface_v1": 1, **ours}


class SGLangRig:
    """One rank's SGLang HiCache stack. ``backend``: ``file`` or ``dynamic``."""

    def __init__(
        self,
        shape: RigShape,
        backend: str,
        extra_config: Mapping[str, object],
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        model_name: str = "tiered-kv-test@r1",
        storage_metrics: bool = False,
        group: bool = False,
    ) -> None:
        """``group``: SGLang's ``HybridCacheController`` over a one-entry ``HostPoolGroup`` (the
        KV pool as its anchor), which is what its ``UnifiedRadixCache`` builds for a plain MHA /
        MLA model (``build_kv_only_stack``); else the base ``HiCacheController``."""
        if shape.layout not in IO_BACKENDS:
            raise StateError(f"layout {shape.layout!r}: the rig runs {sorted(IO_BACKENDS)}")
        mem = importlib.import_module("sglang.srt.mem_cache.memory_pool")
        alloc_mod = importlib.import_module("sglang.srt.mem_cache.allocator")
        ctrl_mod = importlib.import_module("sglang.srt.managers.cache_controller")
        parallel = importlib.import_module("sglang.srt.runtime_context").get_parallel()
        self.shape = shape
        n, ps, last = shape.device_tokens, shape.page_size, shape.layers - 1
        if shape.mla:
            kv = mem.MLATokenToKVPool(
                n, ps, shape.dtype, shape.kv_lora_rank, shape.rope_dim, shape.layers, "cpu",
                False, start_layer=0, end_layer=last,
            )  # fmt: skip
            host_cls = importlib.import_module("sglang.srt.mem_cache.pool_host.mla")
            host = host_cls.MLATokenToKVPoolHost(
                kv.get_device_pool_infos()[0].buffer_info, shape.host_ratio, 0, ps,
                shape.layout, pin_memory=False, device_capacity_tokens=kv.size,
                start_layer=kv.start_layer, end_layer=kv.end_layer,
                target_layer_num=kv.layer_num, override_kv_cache_dim=kv.kv_cache_dim,
            )  # fmt: skip
            self.device_buffers = list(kv.kv_buffer)
        else:
            kv = mem.MHATokenToKVPool(
                n, ps, shape.dtype, shape.heads, shape.head_dim, shape.layers, "cpu", False,
                start_layer=0, end_layer=last,
            )  # fmt: skip
            host_cls = importlib.import_module("sglang.srt.mem_cache.pool_host.mha")
            host = host_cls.MHATokenToKVPoolHost(
                kv.get_device_pool_infos()[0].buffer_info, shape.host_ratio, 0, ps,
                shape.layout, pin_memory=False, device_capacity_tokens=kv.size,
                start_layer=kv.start_layer, end_layer=kv.end_layer,
            )  # fmt: skip
            self.device_buffers = list(kv.k_buffer) + list(kv.v_buffer)
        stand_ins = importlib.import_module("peer_kvcacheio_cpu")
        stand_ins.register_tensors(self.device_buffers)  # the pointer-table ops resolve them
        self.kv, self.host = kv, host
        self.allocator = alloc_mod.PagedTokenToKVPoolAllocator(n, ps, shape.dtype, "cpu", kv, False)
        pools, controller_cls = host, ctrl_mod.HiCacheController
        self.group = group
        if group:
            assembler = importlib.import_module(
                "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"
            )
            group_mod = importlib.import_module("sglang.srt.mem_cache.pool_host.group")
            hybrid = importlib.import_module(
                "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller"
            )
            entry = assembler.build_pool_entry(
                name=importlib.import_module("sglang.srt.mem_cache.hicache_storage").PoolName.KV,
                host_pool=host, device_pool=kv, layer_mapping={i: i for i in range(kv.layer_num)},
                transfer_layer_id_max=kv.layer_num, is_anchor=True,
            )  # fmt: skip
            pools, controller_cls = group_mod.HostPoolGroup([entry]), hybrid.HybridCacheController
        with parallel.override(
            tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_dcp_size=1,
            attn_dcp_rank=0,
        ):  # fmt: skip
            self.controller = controller_cls(
                self.allocator, pools, ps, None, threading.Event(),
                io_backend=IO_BACKENDS[shape.layout], storage_backend=backend,
                prefetch_threshold=ps, model_name=model_name,
                storage_backend_extra_config=dict(extra_config),
                enable_storage_metrics=storage_metrics,
            )  # fmt: skip
        self.backend = self.controller.storage_backend
        self._prefetches = 0

    # -- data ----------------------------------------------------------------------------------
    def fill_device(self, num_tokens: int, generator: torch.Generator) -> torch.Tensor:
        """Allocate ``num_tokens`` device slots and write fresh random KV into every layer."""
        slots = self.allocator.alloc(num_tokens)
        if slots is None:
            raise StateError(f"the device pool cannot hold {num_tokens} more tokens")
        for buf in self.device_buffers:
            shape = buf[slots].shape
            buf[slots] = torch.randn(shape, generator=generator).to(buf.dtype)
        return slots

    def device_bytes(self, slots: torch.Tensor) -> list[torch.Tensor]:
        return [buf[slots].view(torch.uint8).clone() for buf in self.device_buffers]

    def scrub_device(self, slots: torch.Tensor) -> None:
        for buf in self.device_buffers:
            buf[slots] = torch.full_like(buf[slots], -7.0)

    # -- SGLang's calls, as its radix cache makes them -----------------------------------------
    def write_to_host(self, device_slots: torch.Tensor) -> torch.Tensor:
        """Device -> host (``write``), waited; the host slots."""
        c = self.controller
        host_slots = c.write(device_slots)
        if host_slots is None:
            raise StateError("the host pool is full")
        c.start_writing()
        while c.ack_write_queue:
            c.ack_write_queue.pop(0).finish_event.synchronize()
        return host_slots

    def backup(self, host_slots: torch.Tensor, tokens: Sequence[int], extra_key=None) -> int:
        """Host -> storage (``write_storage``, SGLang's backup thread); the tokens it stored.
        ``extra_key``: the request's LoRA adapter (SGLang seeds its hashes with it)."""
        c = self.controller
        hashes = self.page_hashes(tokens, extra_key)
        op_id = c.write_storage(host_slots, list(tokens), hashes)
        op = c.ack_backup_queue.get(timeout=ACK_TIMEOUT_S)
        if op.id != op_id:
            raise StateError(f"backup ack for operation {op.id}, expected {op_id}")
        return op.completed_tokens

    def prefetch(self, tokens: Sequence[int], extra_key=None) -> tuple[int, torch.Tensor | None]:
        """Storage -> host (``prefetch``: the hit query, then the transfer into freshly
        allocated host pages); (tokens loaded, their host slots or None on a miss).
        ``extra_key``: the request's LoRA adapter, carried as SGLang does (its ``RadixKey``)."""
        c = self.controller
        self._prefetches += 1
        rid = f"req-{self._prefetches}"
        key = list(tokens)
        if extra_key is not None:
            radix = importlib.import_module("sglang.srt.mem_cache.radix_cache")
            key = radix.RadixKey(array("q", key), extra_key=extra_key)
        if self.group:  # the hybrid controller names a request by its handle
            base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
            c.prefetch(base.CacheRequestHandle(rid, 0), key)
        else:
            c.prefetch(rid, key)
        op = c.prefetch_hit_queue.get(timeout=ACK_TIMEOUT_S)
        if op.storage_hit_count == 0:
            return 0, None
        op.host_indices = self.host.alloc(op.storage_hit_count)
        if op.host_indices is None:
            raise StateError("the host pool is full")
        c.prefetch_buffer.put(op)
        while True:
            try:
                ack = c.ack_prefetch_queue.get(timeout=ACK_TIMEOUT_S)
            except Empty:
                raise StateError("no prefetch ack from SGLang's controller") from None
            if ack.completed_tokens is not None:
                op.completed_tokens = ack.completed_tokens
            if ack.completed_req:
                break
        done = op.completed_tokens
        if done < op.storage_hit_count:
            self.host.free(op.host_indices[done:])
        return done, op.host_indices[:done]

    def load_to_device(self, host_slots: torch.Tensor) -> torch.Tensor:
        """Host -> device (``load`` + ``start_loading``), waited; the device slots."""
        c = self.controller
        device_slots = c.load(host_slots)
        if device_slots is None:
            raise StateError("the device pool is full")
        c.start_loading()
        while c.ack_load_queue:
            c.ack_load_queue.pop(0).finish_event.synchronize()
        return device_slots

    def page_hashes(self, tokens: Sequence[int], extra_key=None) -> list[str]:
        """SGLang's storage page hashes of ``tokens`` (its own function) for a request with
        ``extra_key`` (None: none)."""
        utils = importlib.import_module("sglang.srt.mem_cache.utils")
        if extra_key is None:
            return utils.get_hash_str(list(tokens), None, page_size=self.shape.page_size)
        radix = importlib.import_module("sglang.srt.mem_cache.radix_cache")
        key = radix.RadixKey(array("q", tokens), extra_key=extra_key)
        return utils.get_storage_hash_str(key, None, page_size=self.shape.page_size)

    def close(self) -> None:
        self.controller.detach_storage_backend()
