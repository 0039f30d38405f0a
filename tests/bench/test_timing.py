"""The timing primitives: interleaving order, warm-up, budgets, gc and sync around a call, and
the statistics on lists whose answers are known."""

from __future__ import annotations

import gc
import math

import pytest

from tiered_kv.bench import timing
from tiered_kv.errors import InvalidArgumentError


def _recording_arms(calls: list):
    def arm(name, value):
        def run(arg):
            calls.append((name, arg))
            return value

        return run

    return {"baseline": arm("baseline", 1.0), "candidate": arm("candidate", 2.0)}


def test_interleave_alternates_baseline_and_candidate_round_by_round():
    calls: list = []
    out = timing.interleave(_recording_arms(calls), 3, setup=lambda i: f"draw{i}")
    assert calls == [
        ("baseline", "draw0"), ("candidate", "draw0"),
        ("baseline", "draw1"), ("candidate", "draw1"),
        ("baseline", "draw2"), ("candidate", "draw2"),
    ]  # fmt: skip
    assert out == {"baseline": [1.0] * 3, "candidate": [2.0] * 3}


def test_interleave_runs_and_drops_warmup_rounds():
    calls: list = []
    seen = iter(range(100))
    arms = {"a": lambda arg: (calls.append(arg), next(seen))[1]}
    out = timing.interleave(arms, 2, setup=lambda i: i, warmup=2)
    assert calls == [-2, -1, 0, 1]  # warm-up rounds are negative and run first
    assert out == {"a": [2, 3]}  # their results are dropped


def test_interleave_stops_on_the_budget_of_the_named_arms_only():
    arms = {"baseline": lambda _: 100.0, "candidate": lambda _: 1.0}
    out = timing.interleave(arms, 10, min_repeats=2, budget_s=3.0, budget_arms=("candidate",))
    assert len(out["candidate"]) == 3 and len(out["baseline"]) == 3
    # never fewer than min_repeats, even when the first round is over budget
    out = timing.interleave(arms, 10, min_repeats=2, budget_s=0.5)
    assert len(out["candidate"]) == 2


def test_interleave_calls_after_round_and_rejects_bad_counts():
    rounds: list[int] = []
    timing.interleave({"a": lambda _: 0.0}, 2, warmup=1, after_round=rounds.append)
    assert rounds == [-1, 0, 1]
    with pytest.raises(InvalidArgumentError, match="repeats=0"):
        timing.interleave({"a": lambda _: 0.0}, 0)


def test_timed_turns_gc_off_during_the_call_syncs_both_sides_and_restores_gc():
    events: list[str] = []

    def fn():
        events.append("gc on" if gc.isenabled() else "gc off")
        return 42

    assert gc.isenabled()
    seconds, out = timing.timed_call(fn, lambda: events.append("sync"))
    assert out == 42 and seconds >= 0
    assert events == ["sync", "gc off", "sync"]
    assert gc.isenabled()

    def boom():
        raise KeyError("x")

    with pytest.raises(KeyError):
        timing.timed(boom)
    assert gc.isenabled()  # restored even when the call raised


def test_device_sync_is_a_no_op_off_cuda():
    assert timing.device_sync("cpu") is timing.no_sync


def test_median_and_nearest_rank_percentiles_on_known_lists():
    assert timing.median([3.0, 1.0, 2.0]) == 2.0
    assert timing.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    values = list(range(1, 11))  # 1..10
    assert timing.nearest_rank(values, 0.9) == 9
    assert timing.nearest_rank(values, 0.91) == 10
    assert timing.nearest_rank(values, 1.0) == 10
    assert timing.nearest_rank(values, 0.1) == 1
    assert timing.nearest_rank([5.0], 0.5) == 5.0
    assert timing.nearest_rank([7, 1, 5, 3], 0.5) == 3  # ceil(0.5 * 4) = 2nd smallest
    with pytest.raises(InvalidArgumentError):
        timing.nearest_rank(values, 0.0)
    with pytest.raises(InvalidArgumentError, match="no values"):
        timing.median([])


def test_spread_iqr_and_gbps():
    assert timing.spread([2.0, 4.0, 3.0]) == 2.0
    assert timing.spread([0.0, 1.0]) == math.inf
    # quartiles (nearest rank) of 1..8: p25 = 2, p75 = 6; median 4.5
    assert timing.iqr_ratio([1, 2, 3, 4, 5, 6, 7, 8]) == pytest.approx(4 / 4.5)
    assert timing.iqr_ratio([5.0, 5.0, 5.0, 5.0]) == 0.0
    assert timing.gbps(2_000_000_000, 2.0) == 1.0
