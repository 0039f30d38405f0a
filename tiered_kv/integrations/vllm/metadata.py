"""What the two halves tell each other each step (vLLM's connector metadata, both ways).

Scheduler -> worker (``TieredKVMetadata``): ``loads``, per request the blocks to fill and the
pages (chain digests) to fill them with; ``saves``, per request the blocks that became full
this step and their pages. Worker -> scheduler (``TieredKVWorkerMeta``): the namespace the
worker's pages live under (so the scheduler opens the same store for its lookups) and the host
tier's changes since the last step (so it mirrors which pages the host holds). Plain data (vLLM
pickles it between processes); subclasses of vLLM's classes where vLLM is installed.
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
    """One request's blocks and the page each holds or receives (``digests[i]`` for
    ``blocks[i]``)."""

    req_id: str
    blocks: list[int]
    digests: list[bytes]


@dataclass
class TieredKVMetadata(_VLLMMetadata):
    loads: list[BlockPages] = field(default_factory=list)
    saves: list[BlockPages] = field(default_factory=list)


@dataclass
class TieredKVWorkerMeta(_VLLMWorkerMeta):
    namespace: StorageNamespace
    page_nbytes: int
    changes: list[tuple[bool, bytes]] = field(default_factory=list)  # (on the host now, digest)

    def aggregate(self, other: TieredKVWorkerMeta) -> TieredKVWorkerMeta:
        if other.namespace != self.namespace:
            raise ValueError("workers of one engine report different namespaces")
        return TieredKVWorkerMeta(self.namespace, self.page_nbytes, self.changes + other.changes)
