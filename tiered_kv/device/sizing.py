"""Sizing helpers: how much KV one decode step may allocate and how wide a request row must be.

Every quantity derives from one explicit :class:`AllocSizingConfig` (speculative decoding
settings, page size, decode-context-parallel size, overlap scheduling; ``tiered_kv.sizing_config``)
instead of process globals, so the row width, the per-step reserve and the page size cannot
disagree.
"""

from __future__ import annotations

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.sizing_config import (
    DRAFT_KV_ALGORITHMS,
    SPEC_ALGORITHMS,
    AllocSizingConfig,
    get_alloc_page_size,
    resolve_sizing,
)

__all__ = [
    "DRAFT_KV_ALGORITHMS",
    "SPEC_ALGORITHMS",
    "AllocSizingConfig",
    "draft_tree_spans",
    "get_alloc_len_per_decode",
    "get_alloc_page_size",
    "get_alloc_reserve_per_decode",
    "get_mamba_tracking_slots",
    "get_req_to_token_extra_context_len",
    "max_speculative_num_draft_tokens",
    "request_row_width",
    "resolve_sizing",
    "span_pages",
]


def max_speculative_num_draft_tokens(cfg: AllocSizingConfig) -> int | None:
    return cfg.speculative_num_draft_tokens if cfg.speculative_algorithm is not None else None


def get_alloc_len_per_decode(cfg: AllocSizingConfig) -> int:
    """KV length one request may allocate in a single decode step."""
    algo = cfg.speculative_algorithm
    if algo is None:
        return 1
    spec_steps = cfg.speculative_num_steps or 1
    spec_topk = cfg.speculative_eagle_topk or 1
    spec_tokens = max_speculative_num_draft_tokens(cfg) or 0
    page_size = get_alloc_page_size(cfg)
    if algo == "uno":
        if cfg.speculative_num_draft_tokens is None:
            raise InvalidArgumentError(
                "speculative_algorithm='uno' needs speculative_num_draft_tokens"
            )
        # UNO keeps one clean-root position beside the draft slots.
        return spec_tokens + 1
    if page_size == 1 or spec_topk == 1 or algo not in DRAFT_KV_ALGORITHMS:
        return max(spec_steps * spec_topk, spec_tokens)
    # Tree drafts with pages: each of the topk branches may start anywhere in a page, so its
    # worst case is ceil((page_size - 1 + steps) / page_size) pages of its own.
    pages_per_branch = (page_size - 1 + spec_steps + page_size - 1) // page_size
    return max(pages_per_branch * page_size * spec_topk, spec_tokens)


def get_alloc_reserve_per_decode(cfg: AllocSizingConfig) -> int:
    """KV length reserved per request at each decode step. Under overlap scheduling twice the
    step length: the committed length lags the device by one step (a double buffer)."""
    return (2 if cfg.overlap_schedule else 1) * get_alloc_len_per_decode(cfg)


def draft_tree_spans(cfg: AllocSizingConfig, seq_len: int) -> list[tuple[int, int]]:
    """The (prefix_len, seq_len) spans one decode step allocates for a request holding
    ``seq_len`` tokens: none without speculative decoding (the step's one token is the
    engine's own extend). A draft tree with pages and topk > 1 gives each of its topk branches
    pages of its own: a copy of the request's partial last page, then the branch's ``steps``
    tokens (the worst case, ``page_size - 1`` tokens copied, is what
    :func:`get_alloc_len_per_decode` reserves). Otherwise one span of that length continues
    the request (draft or verify tokens in a row)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise InvalidArgumentError(f"seq_len={seq_len!r} must be an int >= 0")
    algo = cfg.speculative_algorithm
    if algo is None:
        return []
    page_size, topk = get_alloc_page_size(cfg), cfg.speculative_eagle_topk or 1
    if algo in DRAFT_KV_ALGORITHMS and page_size > 1 and topk > 1:
        steps = cfg.speculative_num_steps or 1
        start = seq_len - seq_len % page_size
        return [(start, seq_len + steps)] * topk
    return [(seq_len, seq_len + get_alloc_len_per_decode(cfg))]


def span_pages(span: tuple[int, int], page_size: int) -> int:
    """New pages a (prefix_len, seq_len) span allocates (the prefix's pages are held)."""
    start, end = span
    return -(-end // page_size) - -(-start // page_size)


def get_req_to_token_extra_context_len(cfg: AllocSizingConfig) -> int:
    """Columns a ``req_to_token`` row needs beyond the model context length, to hold the decode
    over-allocation (and, with pages or UNO, the page-rounded double-buffer reserve)."""
    extra = 4 + (max_speculative_num_draft_tokens(cfg) or 0)
    page_size = get_alloc_page_size(cfg)
    if cfg.speculative_algorithm is not None and (
        page_size > 1 or cfg.speculative_algorithm == "uno"
    ):
        extra = max(extra, get_alloc_reserve_per_decode(cfg) + page_size - 1)
    return extra


def get_mamba_tracking_slots(*, extra_buffer: bool, overlap: bool, lazy: bool = False) -> int:
    """Mamba slots a fresh request takes beside its own to track state for the prefix cache.

    None without the extra buffer. With it, overlap scheduling needs two (step t writes the
    tracked state while step t-1's copy is still being read: a ping-pong pair), else one; lazy
    mode takes one now and defers the second until the request reaches a tracking boundary."""
    for name, value in (("extra_buffer", extra_buffer), ("overlap", overlap), ("lazy", lazy)):
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"{name}={value!r} must be a bool")
    if not extra_buffer:
        return 0
    if lazy:
        return 1
    return 2 if overlap else 1


def request_row_width(sizing: AllocSizingConfig, max_context_len: int) -> int:
    """Columns of a request row: the model's context plus the decode over-allocation's
    headroom (:func:`get_req_to_token_extra_context_len`)."""
    return max_context_len + get_req_to_token_extra_context_len(sizing)
