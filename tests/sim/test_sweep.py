"""The sweep: effective capacities, the parallel run equal to the serial one, the bound check
that fires, and the conversation trace generator."""

from __future__ import annotations

import pytest

from tiered_kv.sim import sweep as sweep_mod
from tiered_kv.sim.belady import access_sequence, belady_hits
from tiered_kv.sim.sweep import BoundExceededError, check_bounds, effective_blocks, sweep
from tiered_kv.sim.traces import conversation, load_mooncake, multi_round_qa, write_mooncake
from tiered_kv.tree.policies import POLICIES


def _mrq():
    return multi_round_qa(
        users=4, rounds=3, shared_prompt=48, history=16, answer=16, num_shared_prompts=2, seed=3
    )


@pytest.mark.parametrize(
    "device, host, storage, policy, expected",
    [
        (10, 20, 0, "write_through", 20),  # inclusive: the host holds the device's blocks too
        (10, 5, 0, "write_through", 10),  # a host smaller than the device adds nothing
        (10, 20, 50, "write_through", 50),  # storage backs up the host: inclusive again
        (10, 20, 0, "write_through_selective", 30),
        (10, 20, 50, "write_through_selective", 60),
        (10, 20, 0, "write_back", 30),
        (10, 20, 50, "write_back", 80),
        (10, 0, 0, "write_back", 10),
    ],
)
def test_effective_blocks(device, host, storage, policy, expected):
    assert effective_blocks(device, host, storage, policy) == expected


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_parallel_rows_equal_the_serial_run_in_order(write_policy):
    trace = _mrq()
    args = (trace, [0.1, 0.3, 1.0], list(POLICIES), 2.0, 0.2, write_policy, False)
    serial = sweep(*args, jobs=1)
    parallel = sweep(*args, jobs=2)
    strip = [{k: v for k, v in r.items() if k != "seconds"} for r in serial["rows"]]
    assert strip == [{k: v for k, v in r.items() if k != "seconds"} for r in parallel["rows"]]
    assert {k: v for k, v in serial.items() if k != "rows"} == {
        k: v for k, v in parallel.items() if k != "rows"
    }


def test_bounds_are_belady_at_the_effective_and_the_total_capacity():
    trace = _mrq()
    accesses = access_sequence(trace)
    out = sweep(trace, [0.2], ["lru"], 2.0, 0, "write_through", False, jobs=1)
    (r,) = out["rows"]
    assert r["effective_blocks"] == r["host_blocks"]
    assert r["total_blocks"] == r["device_blocks"] + r["host_blocks"]
    assert r["effective_rate"] == belady_hits(accesses, r["effective_blocks"]) / len(accesses)
    assert r["total_rate"] == belady_hits(accesses, r["total_blocks"]) / len(accesses)
    assert r["hits"] == round(r["hit_rate"] * len(accesses))


def test_a_rate_above_the_bound_fails_the_run(monkeypatch):
    """The check itself: a bound of 0 hits must stop the sweep, naming the policy."""
    monkeypatch.setattr(sweep_mod, "belady_hits", lambda accesses, capacity: 0)
    with pytest.raises(BoundExceededError, match="policy lru at .* above Belady's 0"):
        sweep(_mrq(), [0.5], ["lru"], 1.0, 0, "write_through", False, jobs=1)


def test_check_bounds_passes_equal_and_fails_one_over():
    row = {"policy": "lru", "device_blocks": 2, "host_blocks": 2, "storage_blocks": 0}
    check_bounds([{**row, "hits": 5, "total_hits": 5, "total_blocks": 4}])
    with pytest.raises(BoundExceededError, match="hit 6 blocks, above Belady's 5"):
        check_bounds([{**row, "hits": 6, "total_hits": 5, "total_blocks": 4}])


def test_conversation_turns_extend_earlier_turns_and_share_system_prompts(tmp_path):
    trace = conversation(requests=400, system_prompts=3, seed=5)
    assert len(trace) == 400
    assert trace == conversation(requests=400, system_prompts=3, seed=5)
    assert trace != conversation(requests=400, system_prompts=3, seed=6)
    assert [r.timestamp for r in trace] == sorted(r.timestamp for r in trace)
    # A later turn resends an earlier request's blocks as its prefix.
    prefixes = {r.blocks for r in trace}
    extended = sum(any(r.blocks[:n] in prefixes for n in range(1, len(r.blocks))) for r in trace)
    assert extended > len(trace) // 3
    # At most 3 distinct first blocks: every conversation opens with a shared system prompt.
    assert len({r.blocks[0] for r in trace}) <= 3
    for r in trace:  # 512-token blocks: the prompt fills its last block partly
        assert (len(r.blocks) - 1) * 512 < r.input_length <= len(r.blocks) * 512
    path = tmp_path / "conv.jsonl"
    write_mooncake(trace, path)
    back = load_mooncake(path)
    assert [(r.blocks, r.timestamp, r.input_length, r.output_length) for r in back] == [
        (r.blocks, r.timestamp, r.input_length, r.output_length) for r in trace
    ]


@pytest.mark.parametrize(
    "kwargs",
    [{"requests": 0}, {"system_prompts": 0}, {"turn_blocks": (3, 2)}, {"mean_turns": 0.5}],
)
def test_conversation_rejects_bad_sizes(kwargs):
    from tiered_kv.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=next(iter(kwargs))):
        conversation(**kwargs)


@pytest.mark.parametrize("jobs", [1, 2])
def test_progress_counts_rows_and_requests(capsys, jobs):
    trace = _mrq()
    sweep(trace, [0.2, 0.5], ["lru"], 2.0, 0, "write_through", True, jobs=jobs)
    err = capsys.readouterr().err
    assert f"{2 * len(trace)}/{2 * len(trace)}" in err  # requests replayed, all rows
    assert "rows 2/2" in err
