"""build_cache_parts: every component a :class:`TieredKVCache` runs on, built from its config.

The device pool (MHA, MLA, DSA, or a sliding-window pool: two sub-pools, or with
``swa_unified_pool`` one page range over one shared buffer) and its allocator, the request
rows, the host pool from the device pool's declaration (with the host section's own
options), the store under its namespace in the configured ``storage_layout`` (with the storage
section's own options), one transfer-stats object shared by both transfer workers, the tree,
the manager and (with ``load_planner`` and a host tier) the load planner fed by those transfer
stats. A failure part way closes what was built.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import psutil
import torch

from tiered_kv import platform
from tiered_kv.cache import build_state
from tiered_kv.cache.load_planner import LoadPlanner, PlannerPriors
from tiered_kv.cache.manager import CacheManager
from tiered_kv.cache.metrics import CacheMetrics
from tiered_kv.cache.window import SlidingWindow
from tiered_kv.config import TieredKVConfig
from tiered_kv.device.allocator.hisparse import HiSparseTokenToKVPoolAllocator
from tiered_kv.device.allocator.paged import PagedTokenToKVPoolAllocator
from tiered_kv.device.allocator.swa import SWATokenToKVPoolAllocator
from tiered_kv.device.allocator.unified_swa import UnifiedSWATokenToKVPoolAllocator
from tiered_kv.device.dsa_pool import QUANT_BLOCK, DSATokenToKVPool
from tiered_kv.device.kv_cache import KVCache, mha_kv_bytes, mla_kv_bytes
from tiered_kv.device.mha_pool import MHATokenToKVPool
from tiered_kv.device.mla_pool import MLATokenToKVPool
from tiered_kv.device.req_to_token_pool import ReqToTokenPool
from tiered_kv.device.sizing import request_row_width, resolve_sizing
from tiered_kv.device.swa_pool import SWAKVPool
from tiered_kv.device.unified_swa_pool import UnifiedSWAKVPool
from tiered_kv.errors import BackendUnavailableError, HostMemoryError
from tiered_kv.host.host_kv_cache import HostKVCache, host_pool_for
from tiered_kv.host.pool_group import HostPoolGroup
from tiered_kv.names import ModelKind
from tiered_kv.storage import StorageNamespace
from tiered_kv.storage.backends import open_backend
from tiered_kv.storage.guarded_store import GuardedStorage
from tiered_kv.transfer.device_host import DeviceHostTransfer
from tiered_kv.transfer.host_storage import HostStorageTransfer
from tiered_kv.tree.tiered_tree import TieredTree


class CacheParts(NamedTuple):
    device_pool: KVCache | SWAKVPool
    allocator: (
        PagedTokenToKVPoolAllocator | SWATokenToKVPoolAllocator | UnifiedSWATokenToKVPoolAllocator
    )
    req_to_token: ReqToTokenPool
    host_pool: HostKVCache | HostPoolGroup | None  # a group when the pool declares several
    storage: GuardedStorage | None  # the disk store, reopened or turned off when it keeps failing
    device_host: DeviceHostTransfer | None
    host_storage: HostStorageTransfer | None
    manager: CacheManager
    states: object = None  # a hybrid model's RecurrentState (cache.state_hits), else None
    planner: LoadPlanner | None = None  # with ``load_planner`` and a host tier


def device_pool_for(c: TieredKVConfig) -> KVCache | SWAKVPool:
    g, d = c.geometry, c.device
    device = torch.device(d.device)
    if g.model == ModelKind.SWA and d.swa_unified_pool:
        full, window = g.swa_layer_ids()
        return UnifiedSWAKVPool(
            d.device_tokens // d.page_size, d.page_size, g.torch_dtype, g.head_num, g.head_dim,
            full, window, device, v_head_dim=g.v_head_dim, share_bytes=True,
        )  # fmt: skip
    if g.model == ModelKind.SWA:
        full, window = g.swa_layer_ids()
        return SWAKVPool(
            d.device_tokens, swa_tokens(c), d.page_size, g.torch_dtype, g.head_num, g.head_dim,
            full, window, device, v_head_dim=g.v_head_dim,
        )  # fmt: skip
    if g.model == ModelKind.MHA:
        return MHATokenToKVPool(
            d.device_tokens,
            d.page_size,
            g.torch_dtype,
            g.head_num,
            g.head_dim,
            g.num_layers,
            device,
            v_head_dim=g.v_head_dim,
        )
    if g.model == ModelKind.DSA:
        return DSATokenToKVPool(
            d.device_tokens, d.page_size, g.torch_dtype, g.kv_lora_rank, g.qk_rope_head_dim,
            g.num_layers, device, index_head_dim=g.index_head_dim,
        )  # fmt: skip
    return MLATokenToKVPool(
        d.device_tokens,
        d.page_size,
        g.torch_dtype,
        g.kv_lora_rank,
        g.qk_rope_head_dim,
        g.num_layers,
        device,
    )


def sliding_window(c: TieredKVConfig, allocator, metrics) -> SlidingWindow | None:
    """A sliding-window model's hit rule and window KV handling (None for other models)."""
    g = c.geometry
    if g.model != ModelKind.SWA:
        return None
    return SlidingWindow(allocator, g.sliding_window, c.device.page_size, metrics)


def swa_tokens(c: TieredKVConfig) -> int:
    return c.device.device_swa_tokens or c.device.device_tokens


def allocator_for(
    c: TieredKVConfig, pool: KVCache | SWAKVPool
) -> PagedTokenToKVPoolAllocator | SWATokenToKVPoolAllocator | UnifiedSWATokenToKVPoolAllocator:
    d = c.device
    sizing = resolve_sizing(d.sizing, d.page_size)
    if isinstance(pool, UnifiedSWAKVPool):
        return UnifiedSWATokenToKVPoolAllocator(
            pool.num_pages, d.page_size, c.torch_dtype, torch.device(d.device), pool,
            sizing=sizing, skip_freed_window=True,
        )  # fmt: skip
    if isinstance(pool, SWAKVPool):
        return SWATokenToKVPoolAllocator(
            d.device_tokens, swa_tokens(c), d.page_size, c.torch_dtype, torch.device(d.device),
            pool, sizing=sizing,
        )  # fmt: skip
    if d.hisparse_logical_ratio:  # logical slots for every token, device slots for some
        return HiSparseTokenToKVPoolAllocator(
            d.device_tokens, d.page_size, c.torch_dtype, torch.device(d.device), pool,
            host_to_device_ratio=d.hisparse_logical_ratio, sizing=sizing,
        )  # fmt: skip
    return PagedTokenToKVPoolAllocator(
        d.device_tokens, d.page_size, c.torch_dtype, torch.device(d.device), pool, sizing=sizing
    )


def check_device_present(c: TieredKVConfig) -> None:
    """Refuse, naming the field, a device this process does not have. A config is data (built,
    saved and sized anywhere); the cache is where the device must exist, checked before any
    tensor is allocated (torch's own error would be an AssertionError from deep inside)."""
    try:
        platform.resolve_device(c.device.device)
    except BackendUnavailableError as exc:
        raise BackendUnavailableError(f"TieredKVConfig.device={c.device.device!r}: {exc}") from None


def check_device_fits(c: TieredKVConfig) -> None:
    """Refuse, naming the field, a device pool or request table this machine cannot hold
    (instead of an untyped allocation error from torch half way through the build)."""
    g, d = c.geometry, c.device
    tokens = d.device_tokens + d.page_size
    if g.model == ModelKind.SWA and d.swa_unified_pool:  # one buffer, the larger side's layers
        layers = max(map(len, g.swa_layer_ids()))
        pool = mha_kv_bytes(layers, tokens, g.head_num, g.head_dim, g.torch_dtype)
    elif g.model == ModelKind.SWA:
        full, window = g.swa_layer_ids()
        pool = mha_kv_bytes(len(full), tokens, g.head_num, g.head_dim, g.torch_dtype)
        pool += mha_kv_bytes(
            len(window), swa_tokens(c) + d.page_size, g.head_num, g.head_dim, g.torch_dtype
        )
    elif g.model == ModelKind.HYBRID_LINEAR:
        full, linear = g.hybrid_layer_ids()
        pool = mha_kv_bytes(len(full), tokens, g.head_num, g.head_dim, g.torch_dtype)
        conv, temporal = g.conv_state_shape(), g.temporal_state_shape()
        per_slot = 4 * len(linear) * (conv[0] * conv[1] + temporal[0] * temporal[1] * temporal[2])
        pool += (build_state.state_slots(c) + 1) * per_slot  # float32 conv and temporal state
    elif g.model == ModelKind.MHA:
        pool = mha_kv_bytes(g.num_layers, tokens, g.head_num, g.head_dim, g.torch_dtype)
    else:
        pool = mla_kv_bytes(g.num_layers, tokens, g.kv_lora_rank, g.qk_rope_head_dim, g.torch_dtype)
    if g.model == ModelKind.DSA:  # the indexer's fp8 keys and float32 block scales
        pool += g.num_layers * tokens * (g.index_head_dim + 4 * g.index_head_dim // QUANT_BLOCK)
    width = request_row_width(resolve_sizing(d.sizing, d.page_size), d.max_context_len)
    rows = (d.max_requests + 1) * width * 4  # int32 slot per (row, position)
    cuda = d.device == "cuda"
    free = torch.cuda.mem_get_info()[0] if cuda else psutil.virtual_memory().available
    for nbytes, field in ((pool, "device_tokens"), (pool + rows, "max_context_len")):
        if nbytes > free:
            raise HostMemoryError(
                f"the device pool{' and request table' if field != 'device_tokens' else ''} "
                f"need {nbytes / 2**30:.2f} GiB but the {'GPU' if cuda else 'machine'} has "
                f"{free / 2**30:.2f} GiB free; lower TieredKVConfig.{field}"
                + (" (or max_requests)" if field == "max_context_len" else "")
            )


def build_cache_parts(c: TieredKVConfig) -> CacheParts:
    d, h, s, p = c.device, c.host, c.storage, c.policies
    check_device_present(c)
    check_device_fits(c)
    hybrid = c.geometry.model == ModelKind.HYBRID_LINEAR
    if hybrid:  # the request rows own the recurrent state, the KV pool its full layers
        rows = build_state.hybrid_rows(c)
        pool = build_state.hybrid_pool(c, rows)
    else:
        width = request_row_width(resolve_sizing(d.sizing, d.page_size), d.max_context_len)
        rows = ReqToTokenPool(d.max_requests, width, torch.device(d.device))
        pool = device_pool_for(c)
    allocator = allocator_for(c, pool)
    metrics = CacheMetrics()
    host_pool = storage = namespace = device_host = host_storage = states = None
    opened: list = []
    try:
        if h.host_tokens:
            decls = pool.host_pool_decls()
            host_options = dict(
                layout=h.host_layout,
                size_tokens=h.host_tokens,
                pin=h.pin,
                reserve_bytes=h.reserve_bytes,
                kernel_backend=h.kernel_backend,
            )
            if len(decls) == 1:
                host_pool = host_pool_for(decls[0], allocator, **host_options)
            else:  # every declared part of a page moves and is stored together
                host_pool = HostPoolGroup(decls, allocator, **host_options)
            device_host = DeviceHostTransfer(
                allocator, host_pool, io_backend=h.io_backend, stats=metrics.transfer
            )
            opened.append(device_host)
            if s.storage_bytes:
                namespace = StorageNamespace.for_host_pool(
                    host_pool,
                    tenant=s.namespace_salt,
                    model=s.model_id,
                    rank=s.rank,
                    kv_scales=s.kv_scales_id,
                )
                storage = GuardedStorage(
                    functools.partial(
                        open_backend, s, c.storage_dir, namespace, host_pool.page_nbytes
                    )
                )
                opened.append(storage)
                host_storage = HostStorageTransfer(
                    host_pool, storage, batch_pages=s.storage_batch_pages, stats=metrics.transfer
                )
                opened.append(host_storage)
        if hybrid:
            states = build_state.recurrent_state(c, rows, metrics, opened)
        tree = TieredTree(
            d.page_size,
            device_policy=p.device_policy,
            host_policy=p.host_policy,
            digests=storage is not None or hybrid,  # snapshots are named by page digests
        )
        manager = CacheManager(
            tree,
            allocator,
            host_pool,
            device_host,
            host_storage,
            store=storage,
            namespace=namespace,
            write_policy=p.write_policy,
            selective_hits=p.selective_hits,
            metrics=metrics,
            window=sliding_window(c, allocator, metrics),
            states=states,
        )
    except BaseException:
        for part in reversed(opened):
            with contextlib.suppress(Exception):
                part.close()
        raise
    planner = None
    if p.load_planner and host_pool is not None:
        ps, threshold = d.page_size, p.prefetch_threshold
        planner = LoadPlanner(
            ps, host_pool.page_nbytes // ps, planner_priors(c),
            load_source=metrics.transfer.snapshot,
            probe_tokens=max(1, -(-threshold // ps)) * ps,  # a shorter hit is never fetched
        )  # fmt: skip
    return CacheParts(
        pool, allocator, rows, host_pool, storage, device_host, host_storage, manager, states,
        planner,
    )  # fmt: skip


def planner_priors(c: TieredKVConfig) -> PlannerPriors:
    """The load planner's estimates before it has observed anything (the config's)."""
    p = c.policies
    return PlannerPriors(
        p.planner_host_gbps * 1e9, p.planner_storage_gbps * 1e9, p.planner_host_op_s,
        p.planner_storage_op_s, p.planner_prefill_tokens_per_s,
    )  # fmt: skip
