"""Cache metrics: one stats tree (hits per tier and missed, evictions per tier, storage errors,
transfers per direction), rendered as the ``stats()`` dict (``cache.prom`` exposes the same
counters to Prometheus).

Everything the cache counts lives in one :class:`CacheMetrics`; storage errors are counted in
one place (the manager, for probes and failed storage jobs) plus what the store absorbs itself.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tiered_kv.names import Tier
from tiered_kv.transfer.stats import TransferStats

TIERS = Tier.values()


@dataclass
class RequestHits:
    """Where one request's prompt came from, in tokens."""

    prompt_tokens: int = 0
    device: int = 0
    host: int = 0
    storage: int = 0
    missed: int = 0  # computed by the model (includes the last token, which always is)


@dataclass
class HitCounters:
    requests: int = 0
    prompt_tokens: int = 0
    device: int = 0
    host: int = 0
    storage: int = 0
    missed: int = 0

    def add(self, r: RequestHits) -> None:
        self.requests += 1
        self.prompt_tokens += r.prompt_tokens
        self.device += r.device
        self.host += r.host
        self.storage += r.storage
        self.missed += r.missed


@dataclass
class TierCounters:
    evicted_tokens: int = 0
    evicted_nodes: int = 0
    dropped_tokens: int = 0  # left the tree entirely (no copy kept anywhere below)
    writes_skipped: int = 0  # no room on the tier below


@dataclass
class WindowCounters:
    """Sliding-window models: window KV given back, and hits cut back for want of it."""

    released_tokens: int = 0  # by running requests, for tokens every later query left behind
    evicted_tokens: int = 0  # by cached nodes (tombstoned) when the window side was short
    trimmed_tokens: int = 0  # matched tokens not served: the window KV before them was gone


@dataclass
class StateCounters:
    """Hybrid models: recurrent-state snapshots taken, restored per tier, moved and missed."""

    captured: int = 0  # snapshots kept at the end of a cached prefix
    capture_skipped: int = 0  # no device state slot could be made free for one
    host_skipped: int = 0  # no host state slot for a backup
    stored: int = 0  # snapshots written to the state store
    restored_device: int = 0
    restored_host: int = 0
    restored_storage: int = 0
    evicted_device: int = 0
    evicted_host: int = 0
    store_misses: int = 0  # a probed snapshot the store then failed to serve (or verify)
    errors: int = 0  # state store calls that raised
    trimmed_tokens: int = 0  # matched tokens not served: no snapshot at their end


@dataclass
class PlannerCounters:
    """The load planner's decisions: requests it planned, matched tokens it declined (computed
    instead of loaded), per tier."""

    planned: int = 0
    declined_host_tokens: int = 0
    declined_storage_tokens: int = 0


@dataclass
class VerifyCounters:
    """Sampled live verification (``cache.verify``): restored prefixes sampled and not, checked
    equal, found wrong (their pages quarantined), verifiers that failed, and the tokens."""

    sampled: int = 0
    skipped: int = 0  # restored prefixes not sampled (or no verifier set)
    verified: int = 0  # the verifier found every page equal
    mismatched: int = 0  # prefixes with a wrong page: pages quarantined, the request recomputes
    errors: int = 0  # the verifier raised or answered nonsense: the request recomputes
    stale_cut: int = 0  # prefixes holding a garbage copy (failed load, quarantined): cut back
    verified_tokens: int = 0
    quarantined_pages: int = 0
    recomputed_tokens: int = 0  # restored tokens taken back from requests (computed again)


@dataclass
class CacheMetrics:
    """The one stats tree of a cache."""

    hits: HitCounters = field(default_factory=HitCounters)
    device: TierCounters = field(default_factory=TierCounters)
    host: TierCounters = field(default_factory=TierCounters)
    window: WindowCounters = field(default_factory=WindowCounters)
    state: StateCounters = field(default_factory=StateCounters)
    verify: VerifyCounters = field(default_factory=VerifyCounters)
    planner: PlannerCounters = field(default_factory=PlannerCounters)
    storage_errors: int = 0  # failed probes, refused and failed storage jobs
    transfer: TransferStats = field(default_factory=TransferStats)

    def render(self, store, tree) -> dict:
        """The ``stats()`` dict. ``store``: the page store or None (its own counters are read
        with ``store_stats``); ``tree``: the cache's tree (its tokens per tier: occupancy)."""
        occupancy = {"device_tokens": tree.device_tokens, "host_tokens": tree.host_tokens}
        transfer = {
            d: {
                "bytes": s.bytes,
                "seconds": s.seconds,
                "ops": s.ops,
                "failed_ops": s.failed_ops,
                "gbps": s.gbps,
            }
            for d, s in self.transfer.snapshot().items()
        }
        h, dc, hc, st = self.hits, self.device, self.host, store_stats(store)
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
                # The manager's count plus the disk trouble the store absorbed itself.
                "errors": self.storage_errors + (sum(st.errors.values()) if st else 0),
                "pages": st.pages if st else 0,
                # A store failing every call is reopened, then turned off (GuardedStorage).
                "reopens": st.reopens if st else 0,
                "turned_off": st.turned_off if st else 0,
                "skipped_while_off": st.skipped_while_off if st else 0,
                "off": int(st.off) if st else 0,
            },
            "window": as_dict(self.window),
            "state": as_dict(self.state),
            "verify": as_dict(self.verify),
            "planner": as_dict(self.planner),
            "occupancy": dict(occupancy),
        }


def store_stats(store):
    """The store's own counters, or None (no store, or one so broken it reports none)."""
    if store is None:
        return None
    try:
        return store.stats()
    except Exception:  # noqa: BLE001 - a broken store reports no counters
        return None


def as_dict(obj) -> dict:
    return asdict(obj)
