"""The text tables of ``bench_vllm`` (``vllm_turns``' rows): one row per configuration and turn,
one per connector op and configuration, and the lines that say how vLLM's prefill was priced."""

from __future__ import annotations

from collections.abc import Sequence

from tiered_kv.bench.vllm_turns import CostRow, PrefillCost, TurnRow

TURN_HEADS = ["config", "turn", "reqs", "TTFT p50 ms", "TTFT p99 ms", "prompt tok", "prefill tok",
              "hit tok", "host blk", "store blk", "out tok/s", "wall s"]  # fmt: skip
COST_HEADS = ["config", "op", "blocks", "us/block", "prefill/op"]


def turn_table(rows: Sequence[TurnRow]) -> list[list[object]]:
    return [
        [r.config, r.turn, r.requests, r.ttft_p50_ms, r.ttft_p99_ms, r.prompt_tokens,
         r.prefill_tokens, r.hit_tokens, r.host_blocks, r.store_blocks, r.out_tok_s, r.wall_s]
        for r in rows
    ]  # fmt: skip


def cost_table(rows: Sequence[CostRow]) -> list[list[object]]:
    return [[r.config, r.op, r.blocks, r.us_per_block, r.prefill_over_cost] for r in rows]


def prefill_lines(p: PrefillCost | None, block_size: int) -> list[str]:
    if p is None:
        return ["vLLM prefill per block: not measured (fewer than two calibration lengths)"]
    points = ", ".join(f"{n}: {t:.1f}" for n, t in zip(p.lengths, p.median_ttft_ms, strict=True))
    return [
        f"vLLM prefill per {block_size}-token block ('a recompute' engine, single requests, "
        f"1 output token, median TTFT ms by prompt length: {points}):",
        f"  marginal {p.marginal_us_per_block:.0f} us/block (least-squares slope; prefill/op "
        f"above divides this), mean {p.mean_us_per_block:.0f} us/block (longest prompt's "
        f"TTFT over its blocks)",
    ]
