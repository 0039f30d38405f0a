"""AllocSizingConfig: the settings every sizing formula reads, validated on construction.

Speculative decoding (algorithm, draft steps, top-k, draft tokens), the page size, decode
context parallelism and overlap scheduling. A cache's ``DeviceConfig.sizing`` and every
allocator hold one; ``resolve_sizing`` refuses one whose allocation page size is not the
allocator's. The formulas live in ``tiered_kv.device.sizing``.
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
    overlap_schedule: bool = True  # the next step is scheduled while this one runs

    def __post_init__(self) -> None:
        if not isinstance(self.overlap_schedule, bool):
            raise InvalidArgumentError(
                f"AllocSizingConfig.overlap_schedule={self.overlap_schedule!r}; expected a bool"
            )
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


def get_alloc_page_size(cfg: AllocSizingConfig) -> int:
    """Allocation page size: decode context parallelism splits each page across
    ``attn_dcp_size`` ranks, so one rank's page covers ``page_size * attn_dcp_size`` tokens."""
    return cfg.page_size * cfg.attn_dcp_size


def resolve_sizing(sizing: AllocSizingConfig | None, page_size: int) -> AllocSizingConfig:
    """An allocator's sizing: ``sizing``, whose allocation page size must be the allocator's
    ``page_size`` (a mismatch would size every reserve for other pages), or the plain one."""
    if sizing is None:
        return AllocSizingConfig(page_size=page_size)
    if not isinstance(sizing, AllocSizingConfig):
        raise InvalidArgumentError(
            f"sizing must be an AllocSizingConfig or None, got {type(sizing).__name__}"
        )
    if get_alloc_page_size(sizing) != page_size:
        raise InvalidArgumentError(
            f"sizing page_size={sizing.page_size} x attn_dcp_size={sizing.attn_dcp_size} = "
            f"{get_alloc_page_size(sizing)} tokens per allocation page, but the allocator's "
            f"page_size is {page_size}; they must be equal"
        )
    return sizing
