"""What the two halves tell each other each step (vLLM's connector metadata, both ways).

Scheduler -> worker (``TieredKVMetadata``): ``loads``, per request and KV cache group the
blocks to fill and the pages (chain digests) to fill them with; ``saves``, per request and group
the blocks that became full this step and their pages; ``state_saves``, recurrent-state blocks
vLLM offered at a block boundary (copied after the step's forward, which computes them);
``doomed``, requests told they have external tokens whose load cannot be done (reported failed,
so vLLM recomputes them).
Worker -> scheduler (``TieredKVWorkerMeta``): per worker rank and group, the namespace its pages
live under (so the scheduler opens the same store for its lookups) and its host tier's changes
since the last step (so it mirrors which pages each rank's host holds).
Plain data (vLLM pickles it between processes); subclasses of vLLM's classes where vLLM is
installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiered_kv.storage.keys import StorageNamespace

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata as _VLLMMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorWorkerMetadata as _VLLMWorkerMeta,
    )
except Exception:  # noqa: BLE001 - vLLM absent: the halves still run on their own
    _VLLMMetadata = _VLLMWorkerMeta = object


@dataclass
class BlockPages:
    """One request's blocks of KV cache group ``group`` and the page each holds or receives
    (``digests[i]`` for ``blocks[i]``)."""

    req_id: str
    blocks: list[int]
    digests: list[bytes]
    group: int = 0


@dataclass
class TieredKVMetadata(_VLLMMetadata):
    loads: list[BlockPages] = field(default_factory=list)
    saves: list[BlockPages] = field(default_factory=list)
    state_saves: list[BlockPages] = field(default_factory=list)
    doomed: list[str] = field(default_factory=list)


@dataclass
class RankReport:
    """One worker rank's report for one KV cache group (``group``): the namespace its pages
    live under, their size, and its host tier's changes since its last report (``(on the host
    now, digest)``, in order)."""

    namespace: StorageNamespace
    page_nbytes: int
    changes: list[tuple[bool, bytes]] = field(default_factory=list)
    group: int = 0


@dataclass
class TieredKVWorkerMeta(_VLLMWorkerMeta):
    """Every rank's reports of a step, by ``(rank name, group)`` (rank ``None``: the one
    worker of an engine without tensor or pipeline parallelism). vLLM folds the workers'
    metadata with ``aggregate``."""

    ranks: dict[tuple[str | None, int], RankReport] = field(default_factory=dict)

    def aggregate(self, other: TieredKVWorkerMeta) -> TieredKVWorkerMeta:
        """Both reports' ranks (a rank in both: the same namespace, changes in order). Builds a
        new report: neither input changes."""
        ranks = dict(self.ranks)
        for rank, theirs in other.ranks.items():
            mine = ranks.get(rank)
            if mine is None:
                ranks[rank] = theirs
                continue
            if mine.namespace != theirs.namespace:
                raise ValueError(f"rank {rank!r} reported two namespaces in one step")
            ranks[rank] = RankReport(
                mine.namespace, mine.page_nbytes, mine.changes + theirs.changes, mine.group
            )
        return TieredKVWorkerMeta(ranks)
