"""The text tables of ``bench_vllm`` (``vllm_turns``' rows): one row per configuration and turn,
one per connector op and configuration, one per connector configuration of bytes loaded per hit
token, and the lines that say how vLLM's prefill was priced."""

from __future__ import annotations

from collections.abc import Sequence

from tiered_kv.bench.timing import median
from tiered_kv.bench.vllm_costs import ByteRow, CostRow, PrefillCost
from tiered_kv.bench.vllm_turns import TurnRow

TURN_HEADS = ["config", "turn", "reqs", "TTFT p50 ms", "TTFT p99 ms", "prompt tok", "prefill tok",
              "hit tok", "host blk", "store blk", "out tok/s", "wall s"]  # fmt: skip
COST_HEADS = ["config", "op", "blocks", "us/block", "prefill/op"]
BYTE_HEADS = ["config", "hit tok", "loaded MiB", "B/hit tok", "full B/tok", "loaded/full",
              "window blk", "window skipped", "state blk loaded", "state blk saved",
              "failed reqs"]  # fmt: skip
BYTE_NOTE = (
    "(bytes loaded per hit token: the connector's loaded_bytes, summed over its ranks, over the "
    "tokens vLLM took from it (vllm:external_prefix_cache_hits); full B/tok: every layer with "
    "per-token KV loaded in full, layers x KV heads x 2 x head size x dtype bytes; window blk / "
    "window skipped: sliding-window pages loaded / out of the window, not loaded; state blk: "
    "recurrent-state pages, counted within the loaded bytes)"
)
RESET_NOTE = (
    "c tiered / d restart: vLLM's prefix caching on (its align mode for the recurrent state "
    "needs it) and reset before every later turn, so their hits are the connector's; "
    "a recompute: off; b vllm-pc / d restart+pc: on, never reset"
)


def turn_table(rows: Sequence[TurnRow]) -> list[list[object]]:
    return [
        [r.config, r.turn, r.requests, r.ttft_p50_ms, r.ttft_p99_ms, r.prompt_tokens,
         r.prefill_tokens, r.hit_tokens, r.host_blocks, r.store_blocks, r.out_tok_s, r.wall_s]
        for r in rows
    ]  # fmt: skip


def cost_table(rows: Sequence[CostRow]) -> list[list[object]]:
    return [[r.config, r.op, r.blocks, r.us_per_block, r.prefill_over_cost] for r in rows]


def byte_table(rows: Sequence[ByteRow]) -> list[list[object]]:
    return [
        [r.config, r.hit_tokens, r.loaded_bytes / (1 << 20), r.bytes_per_token,
         r.full_bytes_per_token, r.ratio, r.loaded_window_blocks, r.window_skipped_blocks,
         r.loaded_state_blocks, r.saved_state_blocks, r.failed_load_requests]
        for r in rows
    ]  # fmt: skip


def prefill_lines(p: PrefillCost | None, block_size: int) -> list[str]:
    if p is None:
        return ["vLLM prefill per block: not measured (fewer than two calibration lengths)"]
    points = ", ".join(f"{n}: {t:.1f}" for n, t in zip(p.lengths, p.median_ttft_ms, strict=True))
    spread = "" if p.spread_us_per_block is None else f" +- {p.spread_us_per_block:.0f}"
    if p.resolved:
        marginal = (
            f"  marginal {p.marginal_us_per_block:.0f}{spread} us/block (least-squares slope "
            "+- its standard error; prefill/op above divides this)"
        )
    else:
        marginal = (
            f"  marginal NOT RESOLVED: slope {p.marginal_us_per_block:.0f}{spread} us/block is "
            "not above zero by twice its standard error (noise or warm-up: rerun, add lengths "
            "or repeats); no prefill/op printed"
        )
    return [
        f"vLLM prefill per {block_size}-token block ('a recompute' engine, single requests, "
        f"1 output token, median TTFT ms by prompt length: {points}):",
        f"{marginal}, mean {p.mean_us_per_block:.0f} us/block (longest prompt's TTFT over its "
        "blocks)",
    ]


GOALS = {"tiered / vllm-pc": 1.2, "restart / recompute": 0.33}  # issue 40's TTFT p50 goals


def goal_lines(rows: Sequence[TurnRow], turns: int) -> list[str]:
    """Issue 40's TTFT goals from the turn rows (medians over rounds): the connector's TTFT p50
    over vLLM's own prefix cache's, per turn 2..``turns`` (the median of those ratios), and the
    first turn after the restart's over recomputing it; a goal missed says MISS."""
    by = {(r.config, r.turn): r for r in rows}
    out = []
    pc = [
        by["c tiered", t].ttft_p50_ms / by["b vllm-pc", t].ttft_p50_ms
        for t in range(2, turns + 1)
        if ("c tiered", t) in by and ("b vllm-pc", t) in by and by["b vllm-pc", t].ttft_p50_ms
    ]
    if pc:
        ratio = median(pc)
        out.append(_goal("tiered / vllm-pc", ratio, f"TTFT p50, turns 2-{turns}, median"))
    first = turns + 1
    restart, again = by.get(("d restart", first)), by.get(("a recompute", first))
    if restart is not None and again is not None and again.ttft_p50_ms:
        ratio = restart.ttft_p50_ms / again.ttft_p50_ms
        out.append(_goal("restart / recompute", ratio, f"TTFT p50, turn {first}, engines warmed"))
    return out


def _goal(name: str, ratio: float, what: str) -> str:
    goal = GOALS[name]
    return f"{name} ({what}): {ratio:.2f} (goal <= {goal}: {'ok' if ratio <= goal else 'MISS'})"
