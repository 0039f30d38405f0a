"""Sizing helpers: how much KV one decode step may allocate and how wide a request row must be.

Every quantity derives from one explicit :class:`AllocSizingConfig` (speculative decoding
settings, page size, decode-context-parallel size) instead of process globals, so the row width,
the per-step reserve and the page size cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiered_kv.errors import InvalidArgumentError

# Speculative algorithms that write draft KV into the pool (a tree of topk branches).
DRAFT_KV_ALGORITHMS = frozenset({"eagle", "eagle3", "standalone"})
SPEC_ALGORITHMS = DRAFT_KV_ALGORITHMS | {"ngram", "uno"}


@dataclass(frozen=True)
class AllocSizingConfig:
    """The settings the sizing helpers read. ``speculative_algorithm`` None means no
    speculative decoding; otherwise one of eagle, eagle3, standalone, ngram, uno."""

    page_size: int = 1
    attn_dcp_size: int = 1
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("page_size", "attn_dcp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"AllocSizingConfig.{name}={value!r}; expected int >= 1")
        for name in (
            "speculative_num_steps",
            "speculative_eagle_topk",
            "speculative_num_draft_tokens",
        ):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise InvalidArgumentError(
                    f"AllocSizingConfig.{name}={value!r}; expected None or an int >= 1"
                )
        algo = self.speculative_algorithm
        if algo is not None:
            if not isinstance(algo, str) or algo.lower() not in SPEC_ALGORITHMS:
                raise InvalidArgumentError(
                    f"speculative_algorithm={algo!r}; expected None or one of "
                    f"{sorted(SPEC_ALGORITHMS)}"
                )
            object.__setattr__(self, "speculative_algorithm", algo.lower())


def max_speculative_num_draft_tokens(cfg: AllocSizingConfig) -> int | None:
    return cfg.speculative_num_draft_tokens if cfg.speculative_algorithm is not None else None


def get_alloc_page_size(cfg: AllocSizingConfig) -> int:
    """Allocation page size: decode context parallelism splits each page across
    ``attn_dcp_size`` ranks, so one rank's page covers ``page_size * attn_dcp_size`` tokens."""
    return cfg.page_size * cfg.attn_dcp_size


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
    """KV length reserved per request at each decode step. Twice the step length: with overlap
    scheduling the committed length lags the device by one step (a double buffer)."""
    return 2 * get_alloc_len_per_decode(cfg)


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
