"""The connector's scheduler half: how much of a request's prompt the tiers hold, which blocks to
load into and which to save, per step (bookkeeping only: it copies nothing).

A request's pages are its full blocks, named by tiered_kv's chain digests over its tokens
(``storage.keys.page_digests``), chained from its identity beyond the tokens
(``request_identity``: the LoRA adapter, the cache salt, multimodal inputs), so two requests
share a page only when the tokens before it and their identity are the same. Decisions forced
by vLLM's API (docs/vllm_connector.md):

- Only full blocks are stored and loaded; the prompt's last token is always computed by vLLM
  (it needs one to sample), so a hit stops one token short of the prompt.
- A block is saved in the step that makes it full (its tokens all computed), from tokens vLLM
  has accepted (speculative drafts never reach a page); blocks the tiers already held when the
  request was looked up, and blocks loaded, are not saved again.
- A request whose tokens do not determine its KV (prompt embeddings) is neither looked up nor
  saved.
- Preemption frees a request's blocks: its pending load is dropped (it is looked up again when
  it resumes); pages already saved stay saved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tiered_kv.errors import StateError
from tiered_kv.integrations.vllm.metadata import BlockPages, TieredKVMetadata
from tiered_kv.storage.keys import extra_key_prior, page_digests

NULL_BLOCK = 0  # vLLM's block pool hands out block 0 as the null block: it never holds KV


def request_identity(request: object) -> str | None:
    """What besides its tokens decides a request's KV, as an ``extra_key`` (None: nothing)."""
    parts = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        name = getattr(lora, "lora_name", None)
        path = getattr(lora, "lora_path", None) or getattr(lora, "path", None)
        parts.append(f"lora={name}#{getattr(lora, 'lora_int_id', None)}@{path}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(f"salt={salt}")
    features = getattr(request, "mm_features", None) or []
    if features:  # the whole request's inputs: a placeholder token stands for any image
        ids = [str(getattr(f, "identifier", None) or getattr(f, "mm_hash", "")) for f in features]
        parts.append("mm=" + ",".join(ids))
    return ";".join(parts) or None


@dataclass
class _Tracked:
    request: object
    prior: bytes
    digests: list[bytes] = field(default_factory=list)
    saved: int = 0  # blocks from the start known to be in the tiers (or being written)
    lookup: tuple[int, int] | None = None  # (first block, end block) the tiers can load
    sources: tuple[int, int] = (0, 0)  # the last lookup's tokens on the host, in the store
    failed_load: bool = False  # a load of this request failed: no external hit for it again


class SchedulerSide:
    """``lookup(digests) -> (leading pages on the host, pages after those in the store)`` comes
    from the engine's tiers; ``block_ids`` gives a request's current blocks (vLLM's KV cache
    manager)."""

    def __init__(
        self,
        block_size: int,
        load_async: bool,
        lookup: Callable[[list[bytes]], tuple[int, int]],
        block_ids: Callable[[str], list[int]],
    ) -> None:
        self.block_size = block_size
        self.load_async = load_async
        self._lookup = lookup
        self._block_ids = block_ids
        self._reqs: dict[str, _Tracked] = {}
        self._loads: dict[str, BlockPages] = {}  # committed loads, not yet sent to the worker
        self._in_flight: dict[str, BlockPages] = {}  # sent, until the request finishes loading
        self.hit_tokens = 0

    # -- digests ----------------------------------------------------------------------------
    def _tracked(self, request: object) -> _Tracked | None:
        req_id = request.request_id
        t = self._reqs.get(req_id)
        if t is None:
            if getattr(request, "prompt_embeds", None) is not None:
                return None
            t = self._reqs[req_id] = _Tracked(request, extra_key_prior(request_identity(request)))
        return t

    def _digests(self, t: _Tracked, num_blocks: int) -> list[bytes]:
        have = len(t.digests)
        if num_blocks > have:
            bs = self.block_size
            tokens = list(t.request.all_token_ids[have * bs : num_blocks * bs])
            prev = t.digests[-1] if t.digests else t.prior
            t.digests.extend(page_digests(tokens, bs, prior=prev))
        return t.digests[:num_blocks]

    # -- vLLM's scheduler calls -------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        t = self._tracked(request)
        if t is None:
            return 0, False
        bs = self.block_size
        limit = (len(request.all_token_ids) - 1) // bs
        start = num_computed_tokens // bs
        if start >= limit:
            t.lookup = None
            return 0, False
        digests = self._digests(t, limit)
        on_host, in_store = self._lookup(digests[start:limit])
        end = start + on_host + in_store
        t.lookup = (start, end) if end > start else None
        t.sources = (on_host * bs, in_store * bs)
        t.saved = max(t.saved, end)
        external = end * bs - num_computed_tokens
        if external <= 0:
            return 0, False
        return external, self.load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        t = self._reqs.get(request.request_id)
        if t is None or num_external_tokens <= 0 or t.lookup is None:
            return
        start, end = t.lookup
        end = min(end, start + num_external_tokens // self.block_size)
        ids = list(blocks.get_block_ids()[0])
        if len(ids) < end or NULL_BLOCK in ids[start:end]:
            # vLLM was told these tokens are external: skipping the load would leave it
            # waiting for ever (async) or reading unfilled blocks (layer-wise). Full attention
            # and MLA (the only specs check_engine admits) always hold real blocks here.
            raise StateError(
                f"request {request.request_id}: blocks {ids[start:end]} for external tokens "
                f"{start * self.block_size}..{end * self.block_size} are missing or vLLM's null "
                "block; the KV cache spec must keep every block of the prefix"
            )
        load = BlockPages(request.request_id, ids[start:end], t.digests[start:end])
        self._loads[request.request_id] = load
        t.lookup = None

    def hit_sources(self, request, num_external_tokens: int) -> tuple[int, int]:
        """The request's external tokens split into (from the host tier, from the store)."""
        t = self._reqs.get(request.request_id)
        host = min(t.sources[0] if t is not None else 0, num_external_tokens)
        return host, num_external_tokens - host

    def build_connector_meta(self, out) -> TieredKVMetadata:
        meta = TieredKVMetadata(loads=list(self._loads.values()))
        for load in meta.loads:
            self._in_flight[load.req_id] = load
            self.hit_tokens += len(load.blocks) * self.block_size
        self._loads.clear()
        for req_id in getattr(out, "preempted_req_ids", None) or ():
            self._in_flight.pop(req_id, None)
        scheduled = [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        scheduled += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, computed in scheduled:
            save = self._save_of(req_id, computed + out.num_scheduled_tokens.get(req_id, 0))
            if save is not None:
                meta.saves.append(save)
        return meta

    def _save_of(self, req_id: str, computed_after: int) -> BlockPages | None:
        t = self._reqs.get(req_id)
        if t is None:
            return None
        full = min(computed_after, len(t.request.all_token_ids)) // self.block_size
        if full <= t.saved:
            return None
        digests = self._digests(t, full)
        ids = self._block_ids(req_id)
        # Fewer blocks than computed, or vLLM's null block (id 0, never holding KV) among them:
        # nothing here is safe to save.
        if len(ids) < full or NULL_BLOCK in ids[t.saved : full]:
            return None
        save = BlockPages(req_id, ids[t.saved : full], digests[t.saved : full])
        t.saved = full
        return save

    def update_connector_output(self, output) -> None:
        """Blocks whose load failed are recomputed by vLLM, so they are saved again from there
        (a request's own blocks are its own until it finishes, so a block id names one load).
        An async load is done when its request is reported received; a layer-wise one stays
        until its request finishes."""
        bad = set(getattr(output, "invalid_block_ids", None) or ())
        if bad:
            for req_id, load in self._in_flight.items():
                t = self._reqs.get(req_id)
                failed = [i for i, b in enumerate(load.blocks) if b in bad]
                if t is not None and failed:
                    t.saved = min(t.saved, t.digests.index(load.digests[failed[0]]))
        for req_id in getattr(output, "finished_recving", None) or ():
            self._in_flight.pop(req_id, None)

    def request_finished(self, request) -> None:
        req_id = request.request_id
        self._reqs.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._in_flight.pop(req_id, None)
