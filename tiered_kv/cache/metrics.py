"""Cache metrics: one stats tree (hits per tier and missed, evictions per tier, storage errors,
transfers per direction), rendered as the ``stats()`` dict and as Prometheus text exposition.

Everything the cache counts lives in one :class:`CacheMetrics`; storage errors are counted in
one place (the manager, for probes and failed storage jobs) plus what the store absorbs itself.
"""

from __future__ import annotations

import math
import re
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
class CacheMetrics:
    """The one stats tree of a cache."""

    hits: HitCounters = field(default_factory=HitCounters)
    device: TierCounters = field(default_factory=TierCounters)
    host: TierCounters = field(default_factory=TierCounters)
    window: WindowCounters = field(default_factory=WindowCounters)
    state: StateCounters = field(default_factory=StateCounters)
    storage_errors: int = 0  # failed probes, refused and failed storage jobs
    transfer: TransferStats = field(default_factory=TransferStats)

    def render(self, store, occupancy: dict[str, int]) -> dict:
        """The ``stats()`` dict. ``store``: the page store's own ``StorageStats`` or None."""
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
        h, dc, hc, st = self.hits, self.device, self.host, store
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
            "occupancy": dict(occupancy),
        }


# Cumulative values (Prometheus counters); everything else is a gauge. ``transfer`` holds a
# rate (gbps) besides its counters.
_COUNTER_GROUPS = {"requests", "hits", "transfer", "evictions", "window", "state"}
_GAUGE_KEYS = {"gbps"}
_COUNTER_KEYS = {"checksum_failures", "errors", "reopens", "turned_off", "skipped_while_off"}
_BAD_NAME = re.compile(r"[^a-zA-Z0-9_:]")


def _metric_name(name: str) -> str:
    name = _BAD_NAME.sub("_", name)
    return name if not name[:1].isdigit() else f"_{name}"


def _label_value(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _sample_value(value: float) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
        return repr(value)
    return str(int(value))


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def prometheus_text(stats: dict, prefix: str = "tiered_kv") -> str:
    """Prometheus text format (0.0.4) of the numeric leaves of ``stats`` (nested dicts are
    flattened into labels: ``{"transfer": {"host_to_device": {"bytes": 1}}}`` becomes
    ``tiered_kv_transfer_bytes{direction="host_to_device"} 1``). Each family gets one
    ``# TYPE`` line followed by all its samples; cumulative values are counters."""
    families: dict[str, tuple[bool, list[str]]] = {}

    def emit(name: str, labels: dict[str, str], value: float, counter: bool) -> None:
        metric = _metric_name(f"{prefix}_{name}")
        label = ",".join(f'{k}="{_label_value(v)}"' for k, v in labels.items())
        sample = f"{metric}{{{label}}}" if label else metric
        _, samples = families.setdefault(metric, (counter, []))
        samples.append(f"{sample} {_sample_value(value)}")

    label_of = {"hits": "tier", "transfer": "direction", "evictions": "tier"}
    for group, body in stats.items():
        in_counter_group = group in _COUNTER_GROUPS
        if isinstance(body, dict) and group in label_of:
            for sub, values in body.items():
                if isinstance(values, dict):
                    for k, v in values.items():
                        if _is_number(v):
                            counter = in_counter_group and k not in _GAUGE_KEYS
                            emit(f"{group}_{k}", {label_of[group]: sub}, v, counter)
                elif _is_number(values):
                    emit(f"{group}_tokens_total", {label_of[group]: sub}, values, True)
        elif isinstance(body, dict):
            for k, v in body.items():
                if _is_number(v):
                    counter = (in_counter_group or k in _COUNTER_KEYS) and k not in _GAUGE_KEYS
                    emit(f"{group}_{k}", {}, v, counter)
        elif _is_number(body):
            emit(group, {}, body, in_counter_group)
    lines: list[str] = []
    for metric, (counter, samples) in families.items():
        lines.append(f"# TYPE {metric} {'counter' if counter else 'gauge'}")
        lines.extend(samples)
    return "".join(f"{line}\n" for line in lines)


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
