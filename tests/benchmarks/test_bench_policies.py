"""Smoke test: the policy evaluation runs on small traces, stays under the bound, and judges
the issue-18 bar correctly."""

from __future__ import annotations

import json
import random

from tests.benchmarks import _load
from tiered_kv.sim.traces import long_doc_qa, multi_round_qa


def small_traces(seed: int) -> list:
    mr = multi_round_qa(
        users=5, rounds=3, shared_prompt=96, history=48, answer=32, block_size=16, seed=seed
    )
    ld = long_doc_qa(documents=7, document_length=160, questions=2, block_size=16, seed=seed)
    return [("mr", mr), ("ld", ld)]


def test_rows_stay_under_the_bound_and_lru_closes_nothing():
    bench = _load.load_bench("bench_policies")
    seed = random.randrange(1 << 20)
    policies = ("lru", "ghost_lru", "oracle", "future_count", "next_use")
    rows = bench.evaluate(small_traces(seed), (0.1, 0.3, 0.6), policies)
    assert len(rows) == 2 * 3 * len(policies)
    for r in rows:
        assert 0.0 <= r["hit_rate"] <= r["bound"] + 1e-12, (seed, r)
        if r["policy"] == "lru":
            assert r["hit_rate"] == r["lru_rate"]
            assert r["gap_closed"] in (None, 0.0)
        if r["gap_closed"] is not None:
            want = (r["hit_rate"] - r["lru_rate"]) / (r["bound"] - r["lru_rate"])
            assert abs(r["gap_closed"] - want) < 1e-12


def test_verdict_needs_both_the_closed_gap_and_no_drop():
    bench = _load.load_bench("bench_policies")

    def row(cap, rate, lru=0.2, bound=0.6, policy="x"):
        closed = (rate - lru) / (bound - lru)
        return dict(capacity=cap, policy=policy, hit_rate=rate, lru_rate=lru, gap_closed=closed)

    good = [row(0.05, 0.301), row(0.1, 0.31), row(0.5, 0.196)]  # 0.2525 / 0.275, -0.4 pt
    assert bench.verdict(good, "x")["meets_bar"]
    assert not bench.verdict([*good, row(0.25, 0.19)], "x")["meets_bar"]  # 1 pt below LRU
    short = [row(0.05, 0.299), row(0.1, 0.5)]  # 0.2475 of the gap at 5%
    v = bench.verdict(short, "x")
    assert not v["meets_bar"] and abs(v["least_gap_closed"] - 0.2475) < 1e-9
    assert not bench.verdict([row(0.5, 0.5)], "x")["meets_bar"]  # nothing at 5% / 10%


def test_main_writes_the_table_and_json(tmp_path, capsys):
    bench = _load.load_bench("bench_policies")
    trace = tmp_path / "t.jsonl"
    rng = random.Random(random.randrange(1 << 20))
    lines = []
    for _ in range(40):
        head = [0, 1, 2][: rng.randint(0, 3)]
        lines.append({"hash_ids": head + [rng.randrange(3, 90) * 1000 + len(lines)]})
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "p.json"
    argv = ["--trace", str(trace), "--no-generated", "--capacities", "0.2,0.5"]
    assert bench.main([*argv, "--policies", "lru,ghost_lru", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert [v["policy"] for v in payload["verdicts"]] == ["ghost_lru"]
    assert len(payload["rows"]) == 4
    assert "| t | 0.2 (" in capsys.readouterr().out


def test_the_timeline_counts_and_finds_the_next_access():
    bench = _load.load_bench("bench_policies")
    from tiered_kv.sim.traces import TraceRequest

    trace = [TraceRequest(blocks=b) for b in ([5, 6], [7], [5, 5, 9], [6])]
    tl = bench.Timeline(trace)
    assert tl.after(5, -1) == (2, 0)  # one access per request, however often it repeats
    assert tl.after(5, 0) == (1, 2)
    assert tl.after(5, 2) == (0, 1 << 40)
    assert tl.after(6, 1) == (1, 3) and tl.after(42, 0) == (0, 1 << 40)


def test_knowing_the_future_beats_lru_where_reuse_is_frequency():
    """The diagnostics are not inert: on multi-round QA (shared prompts reused by every user)
    perfect counts beat LRU at a small capacity."""
    bench = _load.load_bench("bench_policies")
    seed = random.randrange(1 << 20)
    mr = multi_round_qa(
        users=24,
        rounds=4,
        shared_prompt=256,
        history=64,
        answer=32,
        block_size=16,
        num_shared_prompts=4,
        seed=seed,
    )
    rows = bench.evaluate([("mr", mr)], (0.1,), ("lru", "future_count"))
    lru, fc = (r["hit_rate"] for r in rows)
    assert fc > lru, (seed, rows)
