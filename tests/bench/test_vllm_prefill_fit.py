"""``bench_vllm``'s pricing of vLLM's prefill and its TTFT goals, without an engine: a slope with
its spread, a slope that noise or warm-up made negative or unresolved is never a price, and the
goal lines from turn rows."""

from __future__ import annotations

import random

import pytest

from tiered_kv.bench import vllm_costs, vllm_tables
from tiered_kv.bench.vllm_turns import TurnRow


def samples(rng: random.Random, per_token_s: float, noise_s: float, lengths, repeats=3):
    return [
        {"prompt_tokens": n, "ttft_s": 0.02 + per_token_s * n + rng.uniform(-noise_s, noise_s)}
        for _ in range(repeats)
        for n in lengths
    ]


def test_a_clean_slope_is_a_price_with_its_spread():
    rng = random.Random(11)
    p = vllm_costs.prefill_cost(samples(rng, 40e-6, 1e-4, (128, 384, 640, 1000)), 32)
    assert p.resolved and p.spread_us_per_block is not None
    assert p.marginal_us_per_block == pytest.approx(40 * 32, rel=0.05)
    assert p.spread_us_per_block < 0.1 * p.marginal_us_per_block
    rows = [vllm_costs.CostRow("c tiered", "store read", 9, 320.0, None)]
    (row,) = vllm_costs.with_ratios(rows, p.marginal_us_per_block)
    assert row.prefill_over_cost == pytest.approx(p.marginal_us_per_block / 320.0)
    assert "NOT RESOLVED" not in "\n".join(vllm_tables.prefill_lines(p, 32))


def test_warm_up_on_the_shortest_prompts_is_no_price():
    """The issue's numbers: median TTFT 269, 163, 74 ms for 128, 384, 768 tokens."""
    by = {128: 0.269, 384: 0.163, 768: 0.074}
    p = vllm_costs.prefill_cost([{"prompt_tokens": n, "ttft_s": t} for n, t in by.items()], 32)
    assert p.marginal_us_per_block < 0 and not p.resolved
    text = "\n".join(vllm_tables.prefill_lines(p, 32))
    assert "NOT RESOLVED" in text and "no prefill/op" in text


def test_a_slope_lost_in_noise_is_unresolved():
    # 32 us of prefill per block under +-50 ms of noise (a fixed draw)
    p = vllm_costs.prefill_cost(
        samples(random.Random(1), 1e-6, 0.05, (128, 256, 384, 512), repeats=1), 32
    )
    assert p.spread_us_per_block is not None and not p.resolved, p
    assert (
        vllm_costs.with_ratios([vllm_costs.CostRow("c", "x", 1, 5.0, None)], None)[
            0
        ].prefill_over_cost
        is None
    )


def row(config, turn, p50):
    return TurnRow(config, turn, 4, p50, p50, 100, 10, 90, 3, 0, 16, 50.0, 1.0)


def test_goal_lines_price_the_connector_against_vllms_cache_and_the_restart():
    rows = [row("a recompute", t, 100.0) for t in (1, 2, 3, 4)]
    rows += [row("b vllm-pc", t, 50.0) for t in (1, 2, 3, 4)]
    rows += [row("c tiered", 1, 100.0), row("c tiered", 2, 55.0), row("c tiered", 3, 70.0)]
    rows += [row("d restart", 4, 40.0)]
    lines = vllm_tables.goal_lines(rows, turns=3)
    assert lines[0].startswith("tiered / vllm-pc") and "1.25" in lines[0] and "MISS" in lines[0]
    assert lines[1].startswith("restart / recompute") and "0.40" in lines[1], lines
    rows[-1] = row("d restart", 4, 30.0)
    assert "0.30" in vllm_tables.goal_lines(rows, turns=3)[1]
    assert vllm_tables.goal_lines(rows, turns=3)[1].endswith("ok)")
