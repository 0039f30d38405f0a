"""Request: what ``TieredKVCache.begin`` hands a serving loop for one request, and the checks
of a prompt's token ids and of free request rows (done once, before anything changes)."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from tiered_kv.cache.lifecycle import PrefixGrant
from tiered_kv.cache.metrics import RequestHits
from tiered_kv.device.req_to_token_pool import RequestKV
from tiered_kv.errors import InvalidArgumentError, StateError
from tiered_kv.storage.keys import extra_key_prior
from tiered_kv.tree.node import TreeNode


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
    grant: PrefixGrant | None = None
    owner: object = None  # the cache that began it (a request is only ever its cache's)
    window_freed: int = 0  # sliding window: tokens before this hold full KV only (page-aligned)
    # Hybrid models: where the engine last said the state was (``track_state``), the slot
    # holding the state at that page boundary, and the next tracking slot's turn.
    state_position: int | None = None
    state_slot_at: tuple[int, int] | None = None
    state_turn: int = 0
    # The per-request identity it was begun with (``begin(extra_key=...)``) and its chain
    # prior: its pages are matched, inserted and stored under that identity only.
    extra_key: str | bytes | None = None
    prior: bytes = b""
    # Whether sampled live verification has decided on its restored prefix (``verify_restored``).
    verify_decided: bool = False

    @property
    def row(self) -> int:
        return self.kv.req_pool_idx


MAX_TOKEN_ID = 0xFFFFFFFF  # page keys hash token ids as uint32


def token_ids(tokens) -> list[int]:
    """Token ids as Python ints (ints, numpy or torch integer scalars, a 1-D integer tensor),
    each in ``0..MAX_TOKEN_ID``; checked here, once, for every path (before anything changes)."""
    try:
        ids = [operator.index(t) for t in tokens]
    except TypeError as exc:
        raise InvalidArgumentError(f"tokens must be integer ids: {exc}") from None
    bad = [t for t in ids if not 0 <= t <= MAX_TOKEN_ID]
    if bad:
        raise InvalidArgumentError(
            f"token ids {bad[:8]} are outside 0..{MAX_TOKEN_ID} (uint32); nothing was changed"
        )
    return ids


def prompt_ids(tokens, max_context_len: int) -> list[int]:
    """A prompt's token ids (``token_ids``), 1..``max_context_len`` of them."""
    tokens = token_ids(tokens)
    if not tokens or len(tokens) > max_context_len:
        raise InvalidArgumentError(f"prompt of {len(tokens)} tokens; need 1..{max_context_len}")
    return tokens


BATCH_ARGS = {  # what a batch call's argument must be, for its error message
    "prompts": "pass a list of prompts, each a sequence of token ids (begin takes one)",
    "reqs": "pass a list of requests (finish takes one)",
    "extra_keys": "pass a list of one extra key (None, str or bytes) per prompt, or None",
}


def batch_list(call: str, name: str, value) -> list:
    """``value`` (a list, tuple or other iterable) as a list, checked before anything changes:
    None, a str or bytes, a lone Request or anything not iterable is refused, naming ``call``,
    ``name`` and the value, then what to pass instead (``BATCH_ARGS[name]``)."""
    if isinstance(value, (str, bytes, Request)) or not hasattr(value, "__iter__"):
        raise InvalidArgumentError(f"{call} got {name}={value!r:.60}; {BATCH_ARGS[name]}")
    return list(value)


def batch_identities(n: int, extra_keys) -> tuple[list, list[bytes]]:
    """The extra keys of a batch of ``n`` prompts (None: none for any) and their chain priors,
    checked before anything changes: one key (or None) per prompt."""
    keys = [None] * n if extra_keys is None else batch_list("begin_many", "extra_keys", extra_keys)
    if len(keys) != n:
        raise InvalidArgumentError(
            f"begin_many got {n} prompts and {len(keys)} extra keys; pass one extra key (or "
            "None) per prompt, or extra_keys=None"
        )
    return keys, [extra_key_prior(k) for k in keys]


def check_rows_free(n: int, free: int, max_requests: int) -> None:
    """StateError unless ``n`` requests find a free request row each."""
    if n > free:
        raise StateError(f"{n} requests need {n} request rows; {free} of {max_requests} are free")
