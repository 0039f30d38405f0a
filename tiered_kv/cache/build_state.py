"""The parts a hybrid model (full attention plus recurrent layers) adds to a cache, from its config.

The request rows are a ``HybridReqToTokenPool`` over a ``MambaPool`` (one conv history and one
recurrent state per recurrent layer and slot; an ``NGramPool`` sibling when
``ngram_context_len`` is set), the device KV pool a ``HybridLinearKVPool`` whose full-attention
layers live on an MHA pool. The state pools' own declarations (the request pool's, not the KV
pool's) give the host state slots, and the state store shares the page store's directory and
budget under a namespace of its own.
"""

from __future__ import annotations

import functools

import torch

from tiered_kv.cache.metrics import CacheMetrics
from tiered_kv.cache.state_hits import RecurrentState
from tiered_kv.cache.state_ledger import StateLedger
from tiered_kv.config import TieredKVConfig
from tiered_kv.device.hybrid_linear_pool import HybridLinearKVPool
from tiered_kv.device.hybrid_req_pool import HybridReqToTokenPool
from tiered_kv.device.mamba_pool import MambaPool
from tiered_kv.device.mha_pool import MHATokenToKVPool
from tiered_kv.device.sizing import request_row_width, resolve_sizing
from tiered_kv.device.slot_states import NGramPool
from tiered_kv.host.state_pool import HostStatePool
from tiered_kv.names import WritePolicy
from tiered_kv.storage.backends import open_backend
from tiered_kv.storage.guarded_store import GuardedStorage

NGRAM_EOS = 0  # the n-gram pool's fill value for positions before a request's first token


def state_slots(c: TieredKVConfig) -> int:
    return c.device.device_state_slots or 4 * c.device.max_requests


def host_state_slots(c: TieredKVConfig) -> int:
    """Host snapshots: as configured, else one per eight host pages, at least 2 per request."""
    h, d = c.host, c.device
    return h.host_state_slots or max(2 * d.max_requests, h.host_tokens // (8 * d.page_size))


def hybrid_rows(c: TieredKVConfig) -> HybridReqToTokenPool:
    g, d = c.geometry, c.device
    device = torch.device(d.device)
    _, linear = g.hybrid_layer_ids()
    size = state_slots(c)
    mamba = MambaPool(
        size=size,
        conv_shapes=[g.conv_state_shape()] * len(linear),
        temporal_shape=g.temporal_state_shape(),
        mamba_layer_ids=linear,
        device=device,
    )
    ngram = None
    if g.ngram_context_len:
        ngram = NGramPool(
            size=size, context_len=g.ngram_context_len, eos_token_id=NGRAM_EOS, device=device
        )
    return HybridReqToTokenPool(
        d.max_requests,
        request_row_width(resolve_sizing(d.sizing, d.page_size), d.max_context_len),
        device,
        mamba_pool=mamba,
        enable_extra_buffer=d.state_extra_buffer,
        overlap=d.state_overlap,
        lazy=d.state_lazy,
        ngram=ngram,
    )


def hybrid_pool(c: TieredKVConfig, rows: HybridReqToTokenPool) -> HybridLinearKVPool:
    g, d = c.geometry, c.device
    full, linear = g.hybrid_layer_ids()
    kv = MHATokenToKVPool(
        d.device_tokens, d.page_size, g.torch_dtype, g.head_num, g.head_dim, len(full),
        torch.device(d.device), v_head_dim=g.v_head_dim,
    )  # fmt: skip
    return HybridLinearKVPool(kv, rows, full, linear)


def recurrent_state(
    c: TieredKVConfig, rows: HybridReqToTokenPool, metrics: CacheMetrics, opened: list
) -> RecurrentState:
    """The snapshot ledger and hit rule; the host state slots when there is a host tier, the
    state store when there is a store (appended to ``opened`` so a failed build closes it)."""
    h, s = c.host, c.storage
    host = store = namespace = None
    if h.host_tokens:
        host = HostStatePool(
            rows.state_pool_decls(), host_state_slots(c), layout=h.host_layout, pin=h.pin
        )
        if s.storage_bytes:
            namespace = host.namespace(model=s.model_id, tenant=s.namespace_salt, rank=s.rank)
            store = GuardedStorage(  # the page store's backend, under the state namespace
                functools.partial(open_backend, s, c.storage_dir, namespace, host.page_nbytes)
            )
            opened.append(store)
    ledger = StateLedger(
        rows.mamba_pool,
        rows.mamba_allocator,
        host,
        store,
        namespace,
        write_through=c.policies.write_policy != WritePolicy.WRITE_BACK,
        counters=metrics.state,
    )
    return RecurrentState(ledger, rows, c.device.page_size, c.device.state_snapshot_every)
