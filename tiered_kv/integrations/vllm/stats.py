"""The connector's counters through vLLM's own hooks: ``KVConnectorStats`` (logged by vLLM's stat
logger, summed across workers) and per-engine Prometheus counters on the server's ``/metrics``
(``tiered_kv_vllm_<counter>_total``: lookups, blocks hit, loaded from the host and from the
store, failed loads, saves, store writes, bytes). Imports vLLM."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from tiered_kv.integrations.vllm.tiers import TierCounters

if TYPE_CHECKING:
    from vllm.config import VllmConfig

PROM_PREFIX = "tiered_kv_vllm_"
HELP = {
    "lookups": "prefix lookups against the host tier and the store",
    "lookup_hit_blocks": "blocks the lookups found on the host tier or in the store",
    "loaded_host_blocks": "blocks loaded into vLLM from the host tier",
    "loaded_store_blocks": "blocks loaded into vLLM from the store (through the host tier)",
    "load_failed_blocks": "blocks that could not be loaded (recomputed by vLLM)",
    "load_no_slot_blocks": "blocks not loaded for want of a free host slot",
    "saved_blocks": "blocks copied from vLLM to the host tier",
    "save_skipped_blocks": "blocks not saved for want of a free host slot",
    "save_dropped_blocks": "blocks not saved because a layer-wise load of their step failed "
    "(the step's KV attended to a block never filled)",
    "save_present_blocks": "blocks not saved because the host tier already held their page",
    "store_written_blocks": "pages the store accepted",
    "store_write_failed_blocks": "pages the store did not store (full, down, refused)",
    "copy_errors": "copies between vLLM's blocks and the host tier that failed",
    "loaded_bytes": "bytes loaded into vLLM's blocks",
    "saved_bytes": "bytes copied out of vLLM's blocks",
    "store_read_us": "microseconds spent reading pages from the store into the host tier",
    "load_copy_us": "microseconds spent copying host pages into vLLM's blocks",
    "save_copy_us": "microseconds spent copying vLLM's blocks to host pages",
    "store_write_us": "microseconds spent writing host pages to the store",
    "loaded_window_blocks": "blocks of sliding-window groups loaded (within the loaded blocks)",
    "loaded_state_blocks": "recurrent-state blocks loaded (within the loaded blocks)",
    "saved_state_blocks": "recurrent-state blocks saved at a block boundary",
    "window_skipped_blocks": "sliding-window blocks a hit did not load: out of the window",
    "failed_load_requests": "requests whose load failed on some rank (hybrid models: "
    "recomputed from their start)",
}
assert set(HELP) == set(TierCounters.NAMES)


class TieredKVStats(KVConnectorStats):
    """Counter increments since the last report (``data``: counter name -> count)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, n in (other.data or {}).items():
            self.data[name] = self.data.get(name, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if v}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StatsDelta:
    """What changed in one or several ``TierCounters`` (summed) since the last ``take``."""

    def __init__(self, *counters: TierCounters) -> None:
        self.counters = counters
        self._last = self._now()

    def _now(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for c in self.counters:
            for k, n in c.snapshot().items():
                total[k] = total.get(k, 0) + n
        return total

    def take(self) -> TieredKVStats | None:
        now = self._now()
        delta = {k: now[k] - self._last.get(k, 0) for k in now if now[k] != self._last.get(k, 0)}
        self._last = now
        return TieredKVStats(data=delta) if delta else None


class TieredKVPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per tiers counter, labelled per engine like vLLM's own."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, text in HELP.items():
            counter = self._counter_cls(
                name=PROM_PREFIX + name, documentation=f"tiered_kv: {text}", labelnames=labelnames
            )
            self._counters[name] = {
                engine: counter.labels(*values) for engine, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        per_engine = {n: c.get(engine_idx) for n, c in self._counters.items()}
        for name, n in (transfer_stats_data or {}).items():
            counter = per_engine.get(name)
            if counter is not None and n > 0:
                counter.inc(n)
