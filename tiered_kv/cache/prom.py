"""The cache's Prometheus exposition: one ``CollectorRegistry`` per cache (or the caller's own),
holding the transfer histograms (:class:`TransferMetrics`, observed once per job) and a
collector that reads the cache's counters and tier occupancy when scraped.

Nothing is recorded per token: the counters are the cache's own ``stats()`` tree, read under the
cache's lock at scrape time, so the hot path pays nothing for them.

Labels are chosen so that summing a family over its label is a meaningful total:
``prompt_tokens_total{source}`` sums to every prompt token (device + host + storage +
computed, each token counted once); ``evicted_tokens_total{tier}`` to the tokens every tier let
go; ``transfer_*{direction}`` to all transfers. Units never mix under one label: storage
evicts pages, so its evictions are their own family.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tiered_kv.cache.metrics import store_stats
from tiered_kv.cache.transfer_metrics import TransferMetrics
from tiered_kv.errors import InvalidArgumentError

_SOURCES = (("device", "device"), ("host", "host"), ("storage", "storage"), ("computed", "missed"))
_EVICTIONS = (
    ("evicted_tokens", "tokens", "Tokens evicted from the tier (the sum: every tier's)."),
    ("evicted_nodes", "nodes", "Tree nodes evicted from the tier."),
    ("dropped_tokens", "dropped_tokens", "Evicted tokens that left the tree (no copy kept)."),
)
_TRANSFER = (
    ("bytes", "Bytes that landed, by direction (partly done jobs included)."),
    ("seconds", "Seconds the copies that landed ran, by direction."),
    ("ops", "Copy operations (a job, or a storage job's batch; failed ones too), by direction."),
    ("failed_ops", "Copy operations that failed, by direction."),
)
_STORAGE = (
    ("errors", "Storage calls and jobs that failed (the cache's and the store's own)."),
    ("checksum_failures", "Stored pages whose checksum did not verify (served as misses)."),
    ("reopens", "Times the store was reopened after failing calls in a row."),
    ("turned_off", "Times the store was turned off (every lookup a miss until it serves)."),
    ("skipped_while_off", "Storage calls answered as misses while the store was off."),
)
_TOKENS = (
    ("capacity_tokens", "Token slots a tier has (device, host)."),
    ("used_tokens", "Token slots in use: cached, running requests' and copies' (device, host)."),
    ("cached_tokens", "Tokens of the prefix tree a tier holds (device, host)."),
)
_STATE_TIERS = {"restored": ("device", "host", "storage"), "evicted": ("device", "host")}


def cache_registry(
    registry: CollectorRegistry | None = None,
) -> tuple[CollectorRegistry, TransferMetrics]:
    """The cache's registry (a fresh one unless given) with its transfer histograms. A registry
    that already holds a cache's metrics is refused: two caches' series would collide."""
    registry = registry if registry is not None else CollectorRegistry()
    try:
        return registry, TransferMetrics(registry)
    except ValueError as exc:  # prometheus_client: "Duplicated timeseries in CollectorRegistry"
        raise InvalidArgumentError(
            f"registry already holds a TieredKVCache's metrics ({exc}); give each cache its "
            "own CollectorRegistry (the default)"
        ) from None


def register_cache(cache, transfers: TransferMetrics) -> None:
    """Show ``cache``'s jobs to ``transfers`` and its counters to ``cache.registry``."""
    cache.manager.jobs.observe = transfers.observe
    cache.registry.register(CacheCollector(cache))


def tier_occupancy(cache) -> dict[str, dict[str, int]]:
    """Per tier the cache has: device and host capacity, use and cache in tokens (the
    allocators' slots; used counts running requests' and copies' slots too, cached only the
    tree's) and the bytes their buffers hold; storage: its budget and the bytes it holds."""
    out = {}
    pools = [("device", cache.allocator, cache.device_pool.get_kv_size_bytes())]
    if cache.host_pool is not None:
        pools.append(("host", cache.host_pool, cache.host_pool.nbytes))
    for tier, pool, nbytes in pools:
        size = pool.size
        used = size - pool.available_size()
        cached = cache.tree.device_tokens if tier == "device" else cache.tree.host_tokens
        out[tier] = {
            "capacity_tokens": size,
            "used_tokens": used,
            "cached_tokens": cached,
            "capacity_bytes": nbytes,
        }
    st = store_stats(cache.storage) if cache.storage is not None else None
    if st is not None:
        out["storage"] = {"capacity_bytes": st.budget_bytes, "used_bytes": st.bytes}
    return out


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _by_label(kind, name: str, doc: str, label: str, values: dict[str, float]) -> Metric:
    family = kind(name, doc, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


class CacheCollector(Collector):
    """The cache's counters and occupancy, read when scraped (from any thread: it takes the
    cache's lock, so a scrape never sees a call half done)."""

    def __init__(self, cache: object, prefix: str = "tiered_kv") -> None:
        self._cache = cache
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        cache, p = self._cache, self.prefix
        with cache._lock:  # noqa: SLF001 - the facade's one lock, shared with its collector
            st, occ = cache.stats(), tier_occupancy(cache)
        yield _counter(f"{p}_requests", "Requests begun.", st["requests"])
        yield _by_label(
            CounterMetricFamily,
            f"{p}_prompt_tokens",
            "Prompt tokens of the requests begun, by where their KV came from (computed: by "
            "the model); the sum over source is every prompt token.",
            "source",
            {source: st["hits"][key] for source, key in _SOURCES},
        )
        ev = st["evictions"]
        for name, key, doc in _EVICTIONS:
            tiers = {t: ev[t][key] for t in ("device", "host")}
            yield _by_label(CounterMetricFamily, f"{p}_{name}", doc, "tier", tiers)
        yield _counter(
            f"{p}_host_writes_skipped",
            "Device -> host copies skipped for want of host room.",
            ev["host"]["writes_skipped"],
        )
        yield _counter(
            f"{p}_storage_evicted_pages", "Pages the store evicted.", ev["storage"]["pages"]
        )
        for key, doc in _TRANSFER:
            values = {d: s[key] for d, s in st["transfer"].items()}
            yield _by_label(CounterMetricFamily, f"{p}_transfer_{key}", doc, "direction", values)
        s = st["storage"]
        for key, doc in _STORAGE:
            yield _counter(f"{p}_storage_{key}", doc, s[key])
        yield GaugeMetricFamily(f"{p}_storage_off", "1 while the store is off.", value=s["off"])
        yield GaugeMetricFamily(f"{p}_storage_pages", "Pages the store holds.", value=s["pages"])
        for key, value in st["window"].items():
            doc = f"Sliding-window models: window {key.replace('_', ' ')}."
            yield _counter(f"{p}_window_{key}", doc, value)
        yield from self._state(st["state"])
        for key, value in st["verify"].items():  # restored prefixes and their pages and tokens
            doc = f"Sampled live verification of restored prefixes: {key.replace('_', ' ')}."
            yield _counter(f"{p}_verify_{key}", doc, value)
        pl = st["planner"]
        yield _counter(
            f"{p}_planner_planned_requests",
            "Requests whose cached prefix the load planner chose what to load of.",
            pl["planned"],
        )
        yield _by_label(
            CounterMetricFamily,
            f"{p}_planner_declined_tokens",
            "Matched prompt tokens the load planner computed rather than loaded, by their tier.",
            "tier",
            {t: pl[f"declined_{t}_tokens"] for t in ("host", "storage")},
        )
        for key, doc in _TOKENS:
            values = {t: o[key] for t, o in occ.items() if key in o}
            yield _by_label(GaugeMetricFamily, f"{p}_tier_{key}", doc, "tier", values)
        yield _by_label(
            GaugeMetricFamily,
            f"{p}_tier_capacity_bytes",
            "Bytes a tier can hold (device, host: its buffers; storage: the store's budget).",
            "tier",
            {t: o["capacity_bytes"] for t, o in occ.items()},
        )
        if "storage" in occ:
            used = occ["storage"]["used_bytes"]
            yield GaugeMetricFamily(f"{p}_storage_used_bytes", "Bytes the store holds.", value=used)

    def _state(self, state: dict[str, int]) -> Iterator[Metric]:
        p = self.prefix
        for event, tiers in _STATE_TIERS.items():
            values = {t: state[f"{event}_{t}"] for t in tiers}
            doc = f"Hybrid models: recurrent-state snapshots {event}, by tier."
            yield _by_label(CounterMetricFamily, f"{p}_state_{event}", doc, "tier", values)
        tiered = {f"{e}_{t}" for e, tiers in _STATE_TIERS.items() for t in tiers}
        for key, value in state.items():
            if key not in tiered:
                doc = f"Hybrid models: recurrent-state {key.replace('_', ' ')}."
                yield _counter(f"{p}_state_{key}", doc, value)
