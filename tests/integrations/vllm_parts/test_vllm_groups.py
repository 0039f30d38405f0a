"""Issue 39: the hybrid groups' hit rule (``integrations/vllm/groups.py``), vLLM-free.

What a hit of E tokens needs per group is exactly what vLLM allocates for it (checked on the
block tables observed in a Gemma-3 engine); the longest hit every group can restore is the
brute-force answer over random presence, with a group missing one page bounding the hit."""

from __future__ import annotations

import random

import pytest

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.integrations.vllm.groups import GroupGrid, GroupKind, GroupPlan

FULL, WINDOW, STATE = GroupKind.FULL, GroupKind.WINDOW, GroupKind.STATE


def test_gemma3_block_tables_observed_in_vllm():
    """Gemma-3, block 32, window 64, a 128-token hit: vLLM's tables were window
    ``[0, 0, 1, 2, 7]`` and full ``[3, 4, 5, 6, 8]`` (the last block for the new tokens)."""
    window = GroupPlan(0, WINDOW, 32, window=64)
    full = GroupPlan(1, FULL, 32)
    assert list(window.needed(0, 128)) == [2, 3]
    assert list(full.needed(0, 128)) == [0, 1, 2, 3]
    assert list(window.needed(96, 128)) == [3]  # vLLM holds the first 96 tokens itself
    assert list(full.needed(128, 128)) == []


def test_state_needs_one_block_at_the_hit_end_and_window_retention_counts():
    state = GroupPlan(0, STATE, 16)
    assert list(state.needed(0, 64)) == [3]
    assert list(state.needed(32, 64)) == [3]
    assert list(state.needed(64, 64)) == []
    kept = GroupPlan(1, WINDOW, 16, window=20, retained=16)
    assert kept.skipped(64) == 64 - 20 + 1 - 16
    assert list(kept.needed(0, 64)) == [1, 2, 3]


def test_grid_unit_step_and_digest_index_over_unequal_block_sizes():
    grid = GroupGrid((GroupPlan(0, FULL, 16), GroupPlan(1, WINDOW, 48, window=40)))
    assert (grid.unit, grid.step) == (16, 48)
    assert grid.digest_index(grid.groups[0], 0) == 0
    assert grid.digest_index(grid.groups[1], 0) == 2  # its block 0 ends at token 48
    assert grid.digest_index(grid.groups[1], 2) == 8
    assert grid.hybrid
    assert not GroupGrid((GroupPlan(0, FULL, 16),)).hybrid


@pytest.mark.parametrize(
    "make",
    [
        lambda: GroupPlan(0, FULL, 0),
        lambda: GroupPlan(0, WINDOW, 16),
        lambda: GroupGrid(()),
        lambda: GroupGrid((GroupPlan(1, FULL, 16),)),
    ],
)
def test_bad_groups_are_refused(make):
    with pytest.raises(InvalidArgumentError):
        make()


def brute_force(grid: GroupGrid, local: int, limit: int, have) -> int:
    top = limit // grid.step * grid.step
    for end in range(top, local, -grid.step):
        if all(all(have(g, b) for b in g.needed(local, end)) for g in grid.groups):
            return end
    return local


GRIDS = [
    (GroupPlan(0, WINDOW, 16, window=40), GroupPlan(1, FULL, 16)),
    (GroupPlan(0, STATE, 32), GroupPlan(1, STATE, 32), GroupPlan(2, FULL, 32)),
    (GroupPlan(0, FULL, 16), GroupPlan(1, WINDOW, 32, window=50, retained=8)),
    (GroupPlan(0, WINDOW, 16, window=17),),
    (GroupPlan(0, FULL, 8),),
]


@pytest.mark.parametrize("grid", [GroupGrid(g) for g in GRIDS])
@pytest.mark.parametrize("seed", range(40))
def test_hit_end_is_the_longest_end_every_group_restores(grid, seed):
    rng = random.Random(seed)
    blocks = 40
    density = rng.choice((0.5, 0.8, 0.95, 1.0))
    held = {
        g.index: {b for b in range(blocks * grid.step // g.block_size) if rng.random() < density}
        for g in grid.groups
    }
    asked = []

    def present(g, bs):
        asked.append(g.index)
        return [b in held[g.index] for b in bs]

    local = rng.randrange(0, 6) * grid.step
    limit = rng.randrange(local, blocks * grid.step)
    got = grid.hit_end(local, limit, present)
    assert got == brute_force(grid, local, limit, lambda g, b: b in held[g.index])
    assert got % grid.step == 0 and local <= got <= limit
    assert len(asked) <= len(grid.groups)  # one question per group


def test_a_window_page_missing_bounds_the_hit_below_it():
    grid = GroupGrid((GroupPlan(0, WINDOW, 16, window=40), GroupPlan(1, FULL, 16)))
    missing = 5  # window block 5 missing: hits ending at blocks 6..8 need it
    got = grid.hit_end(0, 16 * 10, lambda g, bs: [g.index == 1 or b != missing for b in bs])
    assert got == 16 * 10  # ending at 160 needs window blocks [7, 10): 5 is out of it
    got = grid.hit_end(0, 16 * 8, lambda g, bs: [g.index == 1 or b != missing for b in bs])
    assert got == 16 * 5  # ends at 128, 112, 96 all need block 5
