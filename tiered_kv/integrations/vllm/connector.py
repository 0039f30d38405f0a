"""``TieredKVConnector``: tiered_kv's host tier and store behind vLLM's v1 KV connector API.

Loaded by vLLM from ``--kv-transfer-config``::

    {"kv_connector": "TieredKVConnector", "kv_connector_module_path": "tiered_kv.integrations.vllm",
     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"model_id": "<name>@<revision>", "storage_path": "...",
                                   "storage_bytes": 107374182400, "host_bytes": 8589934592}}

vLLM builds one instance per role: the scheduler's (``SchedulerSide``: lookups and the step's
metadata) and the worker's (``WorkerSide``: the copies, on ``ConnectorTiers``). The engine is
checked at startup and anything the connector cannot store correctly is refused by name
(``engine_check``). The connector declares ``SupportsHMA``, so vLLM keeps its hybrid KV cache
manager on: a model with several KV cache groups (sliding-window and full attention, linear
attention's recurrent state) runs on ``HybridSchedulerSide`` / ``HybridWorkerSide``, one set of
tiers per group, pages of every group under one chain of digests and a hit only where every
group can restore it exactly (``groups``). A model with one full-attention group keeps the
single-group path (and its layer-wise loads). Under tensor and
pipeline parallelism each worker rank stores its own shard (its KV heads, its stage's layers)
under a namespace naming its rank (``parallel_rank``), and the scheduler half offers a page only
where every rank holds it (``SchedulerTiers``); vLLM counts a load done when every rank has
reported it, and a block that failed on any rank is recomputed on all. Imports vLLM.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.integrations.vllm.block_layout import describe_groups, describe_layers
from tiered_kv.integrations.vllm.cpu_reserve import warn_once
from tiered_kv.integrations.vllm.engine_check import check_engine
from tiered_kv.integrations.vllm.metadata import RankReport, TieredKVMetadata, TieredKVWorkerMeta
from tiered_kv.integrations.vllm.scheduler_hybrid import HybridSchedulerSide
from tiered_kv.integrations.vllm.scheduler_side import SchedulerSide
from tiered_kv.integrations.vllm.scheduler_tiers import SchedulerTiers
from tiered_kv.integrations.vllm.settings import read_settings
from tiered_kv.integrations.vllm.stats import StatsDelta, TieredKVPromMetrics, TieredKVStats
from tiered_kv.integrations.vllm.tiers import ConnectorTiers
from tiered_kv.integrations.vllm.worker_hybrid import HybridWorkerSide
from tiered_kv.integrations.vllm.worker_side import WorkerSide, idle_step

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Under vLLM's logger: the library's own loggers have only a NullHandler (an application picks
# where they go), and inside vLLM the application is vLLM, whose handler serves ``vllm.*``.
log = logging.getLogger("vllm.tiered_kv.connector")


def parallel_rank(parallel_config) -> str | None:
    """This worker's rank as a namespace field: ``tp<r>of<T>-pp<p>of<P>``, or None for the one
    worker of an engine without tensor or pipeline parallelism (its pages keep the namespace
    they had before ranks were named). Call after vLLM's distributed init (on a worker)."""
    tp, pp = parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size
    if tp * pp == 1:
        return None
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    return f"tp{get_tensor_model_parallel_rank()}of{tp}-pp{get_pp_group().rank_in_group}of{pp}"


class TieredKVConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector over tiered_kv's tiers (see the module docstring)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = read_settings(self._kv_transfer_config.kv_connector_extra_config)
        self.grid = check_engine(vllm_config, kv_cache_config, self.settings)
        self.hybrid = self.grid.hybrid
        self._engine_id = str(self._kv_transfer_config.engine_id)
        self._block_size = self.grid.step
        self._cache_dtype = vllm_config.cache_config.cache_dtype
        self._worker: WorkerSide | HybridWorkerSide | None = None
        self._rank: str | None = None  # the worker's rank name (``parallel_rank``)
        self._stats: StatsDelta | None = None
        self._scheduler: SchedulerSide | None = None
        self._sched_tiers: SchedulerTiers | None = None
        if role == KVConnectorRole.SCHEDULER:
            warn_once(vllm_config, log)  # vLLM's CPU build may leave its engine core no core
            pc = vllm_config.parallel_config
            world = pc.tensor_parallel_size * pc.pipeline_parallel_size
            self._sched_tiers = SchedulerTiers(self.settings, world_size=world)
            self._stats = StatsDelta(self._sched_tiers.counters)
            if self.hybrid:
                st = self._sched_tiers
                self._scheduler = HybridSchedulerSide(
                    self.grid, st.present, lambda g, d: st.lookup(d, g)[0], self._group_ids,
                    st.counters,
                )  # fmt: skip
            else:
                self._scheduler = SchedulerSide(
                    self._block_size, self.settings.load_async, self._sched_tiers.lookup, self._ids
                )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: vLLM computes whatever the connector does not deliver

    # -- the scheduler half ---------------------------------------------------------------
    def _ids(self, req_id: str) -> list[int]:
        return list(self._kv_cache_manager.get_block_ids(req_id)[0])

    def _group_ids(self, req_id: str) -> tuple[list[int], ...]:
        return tuple(list(ids) for ids in self._kv_cache_manager.get_block_ids(req_id))

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        if not self._sched_tiers.ready:
            return None, False  # the worker has not reported its namespace yet: ask again
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        host, store = self._scheduler.hit_sources(request, num_external_tokens)
        out = {CacheHitSource.HOST: host, CacheHitSource.DISK: store}
        return {k: v for k, v in out.items() if v}

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, TieredKVWorkerMeta):
            self._sched_tiers.apply(meta)
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        # Saves copy blocks to the host inside the step that fills them: nothing to wait for.
        self._scheduler.request_finished(request)
        return False, None

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict | None]:
        return self.request_finished(request, block_ids)

    # -- the worker half ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        self._rank = parallel_rank(self._vllm_config.parallel_config)
        if self.hybrid:
            self._register_groups(kv_caches)
            return
        num_blocks = int(self._kv_cache_config.num_blocks)
        layout = describe_layers(kv_caches, num_blocks)
        if layout.block_size != self._block_size:
            raise InvalidArgumentError(
                f"the attention kernel's block size {layout.block_size} differs from vLLM's "
                f"block size {self._block_size}: pass --block-size {layout.block_size}"
            )
        tiers = ConnectorTiers(
            self.settings, layout, rank=self._rank, kv_cache_dtype=self._cache_dtype
        )
        self._worker = WorkerSide(tiers, self.settings.load_async)
        self._stats = StatsDelta(tiers.counters)
        log.info(
            "TieredKVConnector%s: %d layers, %s blocks of %d tokens, %d host pages of %d bytes "
            "(faulted in: %.0f ms), store %s",
            f" rank {self._rank}" if self._rank else "",
            len(layout.layer_ids), layout.layout, layout.block_size, tiers.pages.num_pages,
            layout.page_nbytes, tiers.pages.warm_seconds * 1e3,
            self.settings.storage.storage_backend,
        )  # fmt: skip

    def _register_groups(self, kv_caches) -> None:
        num_blocks = int(self._kv_cache_config.num_blocks)
        layouts = describe_groups(kv_caches, self._kv_cache_config, self.grid, num_blocks)
        slots = self.settings.host_bytes // max(1, sum(x.page_nbytes for x in layouts.values()))
        tiers = {
            g: ConnectorTiers(
                self.settings, layout, rank=self._rank, kv_cache_dtype=self._cache_dtype,
                num_slots=slots,
            )
            for g, layout in layouts.items()
        }  # fmt: skip
        self._worker = HybridWorkerSide(tiers)
        self._stats = StatsDelta(*(t.counters for t in tiers.values()))
        log.info(
            "TieredKVConnector%s: KV cache groups %s, blocks of %d tokens, %d host pages per "
            "group (faulted in: %.0f ms), store %s",
            f" rank {self._rank}" if self._rank else "",
            ", ".join(
                f"{g}:{t.layout.kind.removeprefix('vllm-')} x{len(t.layout.layer_ids)} layers "
                f"({t.layout.page_nbytes} B/page)"
                for g, t in tiers.items()
            ),
            self._block_size, slots, sum(t.pages.warm_seconds for t in tiers.values()) * 1e3,
            self.settings.storage.storage_backend,
        )  # fmt: skip

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, TieredKVMetadata):
            self._worker.begin_saves(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, TieredKVMetadata):
            self._worker.start_load_kv(meta, idle=idle_step(forward_context))

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]):
        if self._worker is None or self.hybrid:
            return None, None
        return None, (self._worker.get_finished() or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if not self.hybrid:
            return super().get_transfer_results(finished_req_ids)
        if self._worker is None:
            return KVConnectorTransferResults()
        # With several groups vLLM takes failures per request only (failed_recving; a failed
        # receive is also a finished one), and recomputes the request from its start.
        finished, failed = self._worker.transfer_results()
        return KVConnectorTransferResults(finished_recving=finished or None, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None or self.hybrid:
            return set()
        return self._worker.load_errors()

    def build_connector_worker_meta(self) -> TieredKVWorkerMeta | None:
        if self._worker is None:
            return None
        if self.hybrid:
            groups = self._worker.tiers.items()
        else:
            groups = [(0, self._worker.tiers)]
        reports = {
            (self._rank, g): RankReport(
                t.namespace, t.layout.page_nbytes, t.slots.take_changes(), group=g
            )
            for g, t in groups
        }
        return TieredKVWorkerMeta(reports)

    def get_kv_connector_stats(self):
        return self._stats.take() if self._stats is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return TieredKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return TieredKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
        if self._sched_tiers is not None:
            self._sched_tiers.close()
