"""``benchmarks/bench_vllm.py``'s measuring function at its smallest: every configuration runs in
its own engine, the table has a row per configuration and turn, the connector's later turns
compute fewer prefill tokens than recomputing, the restarted engine loads from the store, and
the connector's bytes per hit token are the Llama's every layer in full."""

from __future__ import annotations

import pytest

from tiered_kv.bench import report
from tiered_kv.bench import vllm_tables as tables
from tiered_kv.bench import vllm_turns as vt

pytestmark = pytest.mark.slow


def test_bench_vllm_smallest(tiny_model, tmp_path):
    w = vt.Workload(
        conversations=2, system_tokens=64, context_tokens=64, user_tokens=32, output_tokens=4,
        turns=2, restart_turns=1,
    )  # fmt: skip
    result = vt.measure_vllm(
        tiny_model, w, workdir=tmp_path, model_id="tiny@bench-smoke", calibrate_lengths=(64, 160),
        calibrate_repeats=1, parallel=True,
    )  # fmt: skip
    rows = {(r.config, r.turn): r for r in result.rows}
    expected = {(c, t) for c in ("a recompute", "b vllm-pc") for t in (1, 2, 3)}
    expected |= {("c tiered", 1), ("c tiered", 2), ("d restart", 3), ("d restart+pc", 3)}
    assert set(rows) == expected
    table = report.auto_table(tables.TURN_HEADS, tables.turn_table(result.rows))
    assert len(table.splitlines()) == 2 + len(expected)
    assert all(r.requests == 2 and r.output_tokens == 8 for r in result.rows)
    recompute, tiered = rows["a recompute", 2], rows["c tiered", 2]
    assert recompute.prefill_tokens == recompute.prompt_tokens
    assert tiered.prefill_tokens < recompute.prefill_tokens, (tiered, recompute)
    assert tiered.host_blocks > 0
    # after the restart the first turn's prefixes come from the store, not vLLM's empty cache
    for name in ("d restart", "d restart+pc"):
        assert rows[name, 3].store_blocks > 0, rows[name, 3]
        assert rows[name, 3].prefill_tokens < rows["a recompute", 3].prefill_tokens
    ops = {(c.config, c.op) for c in result.costs}
    assert {("c tiered", "host->block copy"), ("c tiered", "block->host copy")} <= ops
    assert ("d restart", "store read") in ops
    assert all(c.us_per_block is not None and c.us_per_block > 0 for c in result.costs)
    assert result.prefill is not None and result.prefill.lengths == [64, 160]
    # a price only where the fit resolved one (engines run at once here: it may not)
    priced = result.prefill.resolved
    assert all((c.prefill_over_cost is not None) == priced for c in result.costs)
    # every engine ran its warm-up batch first; the counters start after it
    assert all(e["warmup_s"] is not None and e["warmup_s"] > 0 for e in result.engines.values())
    # a Llama's hit loads every layer in full: 2 layers x 2 KV heads x (K, V) 32 x float32
    hit = {b.config: b for b in result.bytes}
    assert list(hit) == ["c tiered", "d restart", "d restart+pc"]
    assert hit["c tiered"].hit_tokens == sum(rows["c tiered", t].hit_tokens for t in (1, 2))
    assert all(b.full_bytes_per_token == 2 * 2 * 2 * 32 * 4 and b.ratio == 1 for b in hit.values())
