"""TieredKVConnector, tensor parallel 2: two workers, one KV head each (``parallel_cases``); its
second engine over the store has one rank's shard damaged (a clean second engine: PP)."""

from __future__ import annotations

import pytest

from tests.vllm.parallel_cases import (  # the cases and their fixtures, collected here
    baseline,
    convo,
    test_later_turns_hit_what_every_rank_computed,
    test_one_ranks_damaged_pages_are_recomputed_on_every_rank,
    writer,
)

__all__ = [
    "baseline",
    "convo",
    "writer",
    "test_later_turns_hit_what_every_rank_computed",
    "test_one_ranks_damaged_pages_are_recomputed_on_every_rank",
]


@pytest.fixture(scope="module")
def layout() -> str:
    return "tp2"
