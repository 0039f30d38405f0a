"""TieredKVCache: the one object a serving loop calls.

```
cache = TieredKVCache(TieredKVConfig(...))
req = cache.begin(prompt_tokens)        # match, prefetch from storage, load host hits (layer-wise)
slots = cache.extend(req, n)            # device slots for the next n tokens (prefill)
cache.write_kv(layer, slots, k, v)      # the model writes KV (through KVWriteLoc)
slot = cache.decode(req, token)         # one more token
cache.finish(req)                       # insert the sequence into the tree, release everything
cache.stats(); cache.prometheus()
```
``req.prefix_len`` tokens of the prompt have KV on the device after ``begin`` (its slots are
``req.slots[:req.prefix_len]``; layer i is readable once the layer-done counter says so, which
the device pool's buffer getters wait for). At least the last prompt token is always left to
compute, so the model has a position to produce logits from.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from tiered_kv.cache_controller import CacheController
from tiered_kv.config import TieredKVConfig
from tiered_kv.device.allocator.paged import PagedTokenToKVPoolAllocator
from tiered_kv.device.mha_pool import MHATokenToKVPool
from tiered_kv.device.mla_pool import MLATokenToKVPool
from tiered_kv.device.req_to_token_pool import ReqToTokenPool, RequestKV
from tiered_kv.device.write_loc import KVWriteLoc
from tiered_kv.errors import InvalidArgumentError, StateError
from tiered_kv.host.host_kv_cache import host_pool_for
from tiered_kv.metrics import HitCounters, RequestHits, prometheus_text
from tiered_kv.radix_tree import TreeNode
from tiered_kv.storage import LMDBStorage, StorageNamespace
from tiered_kv.tiered_radix_cache import TieredRadixCache


@dataclass
class Request:
    tokens: list[int]  # tokens whose KV this request holds or is computing
    kv: RequestKV
    slots: torch.Tensor  # device slot per token in ``tokens``
    prefix_len: int
    hits: RequestHits
    node: TreeNode  # deepest tree node locked for this request
    load_slot: int | None = None  # layer-done counter slot of its host -> device load
    finished: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def row(self) -> int:
        return self.kv.req_pool_idx


class TieredKVCache:
    def __init__(self, config: TieredKVConfig) -> None:
        if not isinstance(config, TieredKVConfig):
            raise InvalidArgumentError(
                f"config must be a TieredKVConfig, got {type(config).__name__}"
            )
        self.config = c = config
        device = torch.device(c.device)
        if c.model == "mha":
            self.device_pool = MHATokenToKVPool(
                c.device_tokens,
                c.page_size,
                c.torch_dtype,
                c.head_num,
                c.head_dim,
                c.num_layers,
                device,
                v_head_dim=c.v_head_dim,
            )
        else:
            self.device_pool = MLATokenToKVPool(
                c.device_tokens,
                c.page_size,
                c.torch_dtype,
                c.kv_lora_rank,
                c.qk_rope_head_dim,
                c.num_layers,
                device,
            )
        self.allocator = PagedTokenToKVPoolAllocator(
            c.device_tokens, c.page_size, c.torch_dtype, device, self.device_pool
        )
        self.req_to_token = ReqToTokenPool(c.max_requests, c.max_context_len, device)
        self.host_pool = None
        self.storage = None
        self.controller = None
        namespace = None
        if c.host_tokens:
            (decl,) = self.device_pool.host_pool_decls()
            self.host_pool = host_pool_for(
                decl, self.allocator, layout=c.host_layout, size_tokens=c.host_tokens
            )
            if c.storage_bytes:
                namespace = StorageNamespace.for_host_pool(self.host_pool, tenant=c.namespace_salt)
                self.storage = LMDBStorage(
                    c.storage_dir,
                    namespace,
                    self.host_pool.page_nbytes,
                    budget_bytes=c.storage_bytes,
                )
            self.controller = CacheController(
                self.allocator,
                self.host_pool,
                self.storage,
                io_backend=c.io_backend,
                storage_batch_pages=c.storage_batch_pages,
            )
        self.tree = TieredRadixCache(
            self.allocator,
            self.host_pool,
            self.controller,
            page_size=c.page_size,
            device_policy=c.device_policy,
            host_policy=c.host_policy,
            write_policy=c.write_policy,
            selective_hits=c.selective_hits,
            namespace=namespace,
        )
        self.hits = HitCounters()
        self._closed = False
        self._initial = self.free_sizes()

    # -- request lifecycle --------------------------------------------------------------------
    def begin(self, tokens) -> Request:
        """Start a request for prompt ``tokens``: find its cached prefix on every tier, bring
        storage hits to host (per the prefetch policy) and host hits to the device (layer by
        layer), lock that prefix and give the request a row."""
        self._check_open()
        tokens = _token_ids(tokens)
        if not tokens or len(tokens) > self.config.max_context_len:
            raise InvalidArgumentError(
                f"prompt of {len(tokens)} tokens; need 1..{self.config.max_context_len}"
            )
        kv = RequestKV()
        if self.req_to_token.alloc([kv]) is None:
            raise StateError(f"all {self.config.max_requests} request rows are in use")
        self.tree.check_all()
        usable = tokens[:-1]  # the last prompt token is always computed
        m = self.tree.match_prefix(usable)
        hits = RequestHits(len(tokens), m.device_hit_length, m.host_hit_length, 0, 0)
        node = m.last_node
        if m.storage_hit_length >= max(1, self.config.prefetch_threshold):
            op = self.tree.start_prefetch(m, usable)
            if op is not None:
                gained = self.tree.finish_prefetch(op, self._prefetch_wait(m.storage_hit_length))
                if gained:
                    m2 = self.tree.match_prefix(usable, check_storage=False, count_hit=False)
                    hits.storage = (m2.device_hit_length + m2.host_hit_length) - (
                        m.device_hit_length + m.host_hit_length
                    )
                    hits.storage = max(0, hits.storage)
                    m, node = m2, m2.last_node
        load_slot = None
        slots = m.device_indices
        if m.host_hit_length or (node is not m.last_device_node):
            loaded = self.tree.load_back(node)
            if loaded is None:  # no device room: compute the host part instead
                node = m.last_device_node
                hits.host = hits.storage = 0
            else:
                slots = torch.cat([slots, loaded])
                load_slot = self._start_loading()
        self.tree.inc_lock_ref(node)
        prefix = len(slots)
        hits.missed = len(tokens) - prefix
        hits.host = min(hits.host, prefix - hits.device)
        req = Request(tokens[:prefix], kv, slots, prefix, hits, node, load_slot)
        if prefix:
            self.req_to_token.write((kv.req_pool_idx, slice(0, prefix)), slots.to(torch.int32))
        kv.kv_allocated_len = prefix
        self.hits.add(hits)
        return req

    def _start_loading(self) -> int | None:
        """Issue the queued host -> device loads. The layer-done counter rotates a few producer
        slots and refuses one whose loads are still in flight (and the controller would drop
        the queued loads with that refusal): with that many requests' loads still copying,
        wait for them first."""
        ctl = self.controller
        counter = ctl.layer_done_counter
        if not counter.slot_done((counter.producer + 1) % counter.num_slots):
            ctl.wait_all()
        return ctl.start_loading()

    def prepare_forward(self, req: Request) -> None:
        """Make the device pool's per-layer waits follow ``req``'s host -> device load.
        ``begin`` does this for the request it starts; call it before the forward pass of an
        earlier-begun request when several requests are begun before their forwards run."""
        self._check_live(req)
        if self.controller is not None:
            self.controller.layer_done_counter.set_consumer(req.load_slot)

    def _prefetch_wait(self, tokens: int) -> float | None:
        policy = self.config.prefetch_policy
        if policy == "wait_complete":
            return None
        if policy == "timeout":
            return self.config.prefetch_timeout_s(tokens)
        return 0.0

    def _alloc(self, req: Request, n: int, decode: bool) -> torch.Tensor | None:
        a = self.allocator
        length = len(req.tokens)
        last = req.slots[-1:].to(torch.int64) if length else torch.tensor([-1])
        if decode:
            seq = torch.tensor([length + 1])
            return a.alloc_decode(seq, seq, last)
        pre, seq = torch.tensor([length]), torch.tensor([length + n])
        return a.alloc_extend(pre, pre, seq, seq, last, n)

    def extend(self, req: Request, tokens) -> torch.Tensor:
        """Device slots for ``tokens`` appended to ``req`` (evicting unlocked device pages if
        needed). Raises StateError when the device cannot hold them."""
        self._check_live(req)
        tokens = _token_ids(tokens)
        n = len(tokens)
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        if len(req.tokens) + n > self.config.max_context_len:
            raise InvalidArgumentError(
                f"request would hold {len(req.tokens) + n} tokens; max_context_len is "
                f"{self.config.max_context_len}"
            )
        out = self._alloc(req, n, decode=False)
        if out is None:
            self.tree.make_device_room(n + self.config.page_size)
            out = self._alloc(req, n, decode=False)
        if out is None and self.tree.pending_ops():
            # make_device_room waits for device <-> host copies only; a host -> storage backup
            # in flight protects its node's ancestors too, and a device-only ancestor (its host
            # copy evicted) cannot leave the device without dropping that node. Wait for
            # everything in flight before calling the device full.
            self.drain()
            self.tree.make_device_room(n + self.config.page_size)
            out = self._alloc(req, n, decode=False)
        if out is None:
            raise StateError(
                f"device pool cannot hold {n} more tokens ({self.allocator.available_size()} "
                f"free, {self.tree.evictable_device_tokens()} evictable)"
            )
        start = len(req.tokens)
        self.req_to_token.write((req.row, slice(start, start + n)), out.to(torch.int32))
        req.tokens.extend(tokens)
        req.slots = torch.cat([req.slots, out])
        req.kv.kv_allocated_len = len(req.tokens)
        return out

    def decode(self, req: Request, token: int) -> torch.Tensor:
        """The slot for one more token of ``req``."""
        return self.extend(req, [token])

    def write_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None):
        """The model's KV for ``slots`` of global layer ``layer_id``."""
        self.device_pool.set_kv_buffer(layer_id, KVWriteLoc(slots), k, v)

    def finish(self, req: Request) -> None:
        """Insert ``req``'s whole pages into the tree and release the request: its duplicate
        and partial-page slots are freed, its lock and row returned."""
        self._check_live(req)
        self.tree.check_all()
        full = len(req.tokens) - len(req.tokens) % self.config.page_size
        if self.tree.holds_stale(req.node):
            # Its prefix load failed: the KV it computed on top of it is not worth keeping.
            self.abort(req)
            return
        dup = self.tree.insert(req.tokens[:full], req.slots[:full]) if full else 0
        # The first ``prefix_len`` slots came from the tree: they are its, never ours to free.
        own_dup = req.slots[req.prefix_len : dup] if dup > req.prefix_len else None
        if own_dup is not None and len(own_dup):
            self.allocator.free(own_dup)
        if full < len(req.tokens):
            self.allocator.free(req.slots[full:])
        self.tree.dec_lock_ref(req.node)
        self.req_to_token.free(req.row)
        req.finished = True

    def abort(self, req: Request) -> None:
        """Release ``req`` without inserting anything it computed (a failed forward, a
        cancelled request): its own slots are freed, its lock and row returned."""
        self._check_live(req)
        if len(req.slots) > req.prefix_len:
            self.allocator.free(req.slots[req.prefix_len :])
        self.tree.dec_lock_ref(req.node)
        self.req_to_token.free(req.row)
        req.finished = True

    def _check_live(self, req: Request) -> None:
        self._check_open()
        if not isinstance(req, Request) or req.finished:
            raise StateError(f"request {req!r:.60} is finished or not from this cache")

    def _check_open(self) -> None:
        if self._closed:
            raise StateError("this TieredKVCache is closed")

    # -- housekeeping -------------------------------------------------------------------------
    def poll(self) -> None:
        """Acknowledge finished copies (never blocks); a serving loop calls it every step."""
        self.tree.check_all()

    def drain(self) -> None:
        """Wait for every copy and backup in flight and acknowledge them."""
        if self.controller is not None:
            import time

            for _ in range(100_000):
                self.controller.wait_all()
                self.tree.check_all()
                if not self.tree.pending_ops():
                    return
                time.sleep(0.001)

    def free_sizes(self) -> dict[str, int]:
        out = {
            "device": self.allocator.available_size(),
            "rows": self.req_to_token.available_size(),
        }
        if self.host_pool is not None:
            out["host"] = self.host_pool.available_size()
        return out

    def clear_tree(self) -> None:
        """Evict every unlocked node from every tier (storage keeps its pages)."""
        self.drain()
        self.tree.evict_device(1 << 62)
        self.drain()
        self.tree.evict_host(1 << 62)
        self.drain()

    def stats(self) -> dict:
        ctl = self.controller
        transfer = {}
        if ctl is not None:
            for d, s in ctl.transfer_stats.snapshot().items():
                transfer[d] = {
                    "bytes": s.bytes,
                    "seconds": s.seconds,
                    "ops": s.ops,
                    "failed_ops": s.failed_ops,
                    "gbps": s.gbps,
                }
        h = self.hits
        st = None
        if self.storage is not None:
            try:
                st = self.storage.stats()
            except Exception:  # noqa: BLE001 - a broken store reports no counters
                st = None
        dc, hc = self.tree.device_counters, self.tree.host_counters
        return {
            "requests": h.requests,
            "hits": {
                "prompt": h.prompt_tokens,
                "device": h.device,
                "host": h.host,
                "storage": h.storage,
                "missed": h.missed,
            },
            "transfer": transfer,
            "evictions": {
                "device": {
                    "tokens": dc.evicted_tokens,
                    "nodes": dc.evicted_nodes,
                    "dropped_tokens": dc.dropped_tokens,
                },
                "host": {
                    "tokens": hc.evicted_tokens,
                    "nodes": hc.evicted_nodes,
                    "dropped_tokens": hc.dropped_tokens,
                    "writes_skipped": hc.writes_skipped,
                },
                "storage": {"pages": st.evictions if st else 0},
            },
            "storage": {
                "checksum_failures": st.checksum_failures if st else 0,
                # The tree counts every failed storage call and, when it acknowledges them,
                # every failed background operation (the controller counts those too: adding
                # its count would count each failure twice); the store counts the disk trouble
                # it absorbs itself.
                "errors": self.tree.storage_errors + (sum(st.errors.values()) if st else 0),
                "pages": st.pages if st else 0,
            },
            "occupancy": {
                "device_tokens": self.tree.device_tokens(),
                "host_tokens": self.tree.host_tokens(),
            },
        }

    def prometheus(self) -> str:
        return prometheus_text(self.stats())

    def close(self) -> None:
        """Wait for the copies in flight, stop the background threads, close the store. Safe to
        call twice; requests cannot begin, extend or finish afterwards."""
        self._closed = True
        if self.controller is not None:
            self.drain()
            self.controller.close()
        if self.storage is not None:
            self.storage.close()


def _token_ids(tokens) -> list[int]:
    """Token ids as Python ints (ints, numpy or torch integer scalars, a 1-D integer tensor)."""
    try:
        return [operator.index(t) for t in tokens]
    except TypeError as exc:
        raise InvalidArgumentError(f"tokens must be integer ids: {exc}") from None
