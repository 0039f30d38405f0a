"""TieredKVConnector, pipeline parallel 2: two stages, one layer each (``parallel_cases``)."""

from __future__ import annotations

import pytest

from tests.vllm.parallel_cases import (  # the cases and their fixtures, collected here
    baseline,
    convo,
    test_a_second_engine_serves_every_shard_from_the_store,
    test_later_turns_hit_what_every_rank_computed,
    writer,
)

__all__ = [
    "baseline",
    "convo",
    "writer",
    "test_later_turns_hit_what_every_rank_computed",
    "test_a_second_engine_serves_every_shard_from_the_store",
]


@pytest.fixture(scope="module")
def layout() -> str:
    return "pp2"
