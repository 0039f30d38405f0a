"""Stand-ins for the vLLM objects the scheduler half reads (only the attributes it uses)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tiered_kv.integrations.vllm.scheduler_side import request_identity
from tiered_kv.storage.keys import extra_key_prior, page_digests


@dataclass
class Request:
    request_id: str
    all_token_ids: list[int]
    prompt_embeds: object = None
    lora_request: object = None
    cache_salt: str | None = None
    mm_features: list = field(default_factory=list)


@dataclass
class Lora:
    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass
class Blocks:
    ids: list[int]

    def get_block_ids(self):
        return (list(self.ids),)


@dataclass
class NewReq:
    req_id: str
    num_computed_tokens: int


@dataclass
class CachedReqs:
    req_ids: list[str] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewReq] = field(default_factory=list)
    scheduled_cached_reqs: CachedReqs = field(default_factory=CachedReqs)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)


@dataclass
class ConnectorOutput:
    invalid_block_ids: set[int] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)


def tokens(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=gen).tolist()


def digests_of(request: Request, block_size: int) -> list[bytes]:
    """The page digests of every full block of ``request`` (an oracle, from the keys module)."""
    prior = extra_key_prior(request_identity(request))
    return page_digests(request.all_token_ids, block_size, prior=prior)


class FakeTiers:
    """``lookup`` over two sets of digests: the host tier's and the store's."""

    def __init__(self) -> None:
        self.host: set[bytes] = set()
        self.store: set[bytes] = set()
        self.calls: list[list[bytes]] = []

    def lookup(self, digests):
        self.calls.append(list(digests))
        on_host = 0
        while on_host < len(digests) and digests[on_host] in self.host:
            on_host += 1
        in_store = 0
        while on_host + in_store < len(digests) and digests[on_host + in_store] in self.store:
            in_store += 1
        return on_host, in_store
