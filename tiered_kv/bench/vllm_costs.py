"""What the connector's counters say it cost in ``bench_vllm``'s engines, and what vLLM's own
prefill costs: microseconds per block of each connector op, vLLM's prefill per block (from
single requests of several lengths), and bytes loaded per hit token against loading every
layer's KV in full. Plain arithmetic over counter dictionaries; no engine, no vLLM."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from tiered_kv.bench.timing import median

EXTERNAL_HITS = "vllm:external_prefix_cache_hits"  # tokens vLLM took from the connector
BLOCK_COUNTERS = ("loaded_window_blocks", "window_skipped_blocks", "loaded_state_blocks",
                  "saved_state_blocks", "failed_load_requests")  # fmt: skip


@dataclass
class CostRow:
    """The connector's microseconds per block of one op, and vLLM's prefill per block over it."""

    config: str
    op: str
    blocks: int
    us_per_block: float | None
    prefill_over_cost: float | None


@dataclass
class PrefillCost:
    """vLLM's own prefill cost per block, from single requests of several prompt lengths.

    ``marginal_us_per_block`` is the least-squares slope through the lengths' median TTFTs and
    ``spread_us_per_block`` its standard error (None with two lengths); ``resolved`` says the
    slope is positive and, where a spread exists, above twice it: only then is it a cost a
    connector op may be priced against (``with_ratios``)."""

    lengths: list[int]
    median_ttft_ms: list[float]
    marginal_us_per_block: float
    mean_us_per_block: float
    spread_us_per_block: float | None = None
    resolved: bool = True


@dataclass
class ByteRow:
    """One connector engine's bytes loaded into vLLM's blocks per token it served, against the
    bytes per token of every layer's KV loaded in full (``ratio``: loaded over full); the block
    counters that explain the difference (window pages loaded and skipped, states)."""

    config: str
    hit_tokens: int
    loaded_bytes: int
    bytes_per_token: float | None
    full_bytes_per_token: int
    ratio: float | None
    loaded_window_blocks: int = 0
    window_skipped_blocks: int = 0
    loaded_state_blocks: int = 0
    saved_state_blocks: int = 0
    failed_load_requests: int = 0


def prefill_cost(calibrate: Sequence[dict], block_size: int) -> PrefillCost | None:
    """The least-squares slope of median TTFT over prompt length (times ``block_size``) and the
    longest prompt's TTFT over its blocks; None with fewer than two lengths."""
    by_len: dict[int, list[float]] = {}
    for c in calibrate:
        by_len.setdefault(c["prompt_tokens"], []).append(c["ttft_s"])
    if len(by_len) < 2:
        return None
    lengths = sorted(by_len)
    ttft = [median(by_len[n]) for n in lengths]
    slope, intercept = statistics.linear_regression(lengths, ttft)
    spread = None
    if len(lengths) > 2:
        fitted = [intercept + slope * n for n in lengths]
        residual = sum((t - f) ** 2 for t, f in zip(ttft, fitted, strict=True))
        mean_n = statistics.fmean(lengths)
        spread = (residual / (len(lengths) - 2) / sum((n - mean_n) ** 2 for n in lengths)) ** 0.5
    resolved = slope > 0 and (spread is None or slope > 2 * spread)
    return PrefillCost(
        lengths, [t * 1e3 for t in ttft], slope * block_size * 1e6,
        ttft[-1] / (lengths[-1] / block_size) * 1e6,
        None if spread is None else spread * block_size * 1e6, resolved,
    )  # fmt: skip


COST_OPS = (  # (op, timing counters, block counters)
    ("store read", ("store_read_us",), ("loaded_store_blocks",)),
    ("host->block copy", ("load_copy_us",), ("loaded_host_blocks", "loaded_store_blocks")),
    ("block->host copy", ("save_copy_us",), ("saved_blocks",)),
    ("store write", ("store_write_us",), ("store_written_blocks", "store_write_failed_blocks")),
)


COMBINED = (("load from store", "store read", "host->block copy"),
            ("save", "block->host copy", "store write"))  # fmt: skip


def cost_rows(config: str, counters: dict) -> list[CostRow]:
    """The connector's microseconds per block for each op that moved a block (no ratio)."""
    rows = []
    for op, times, blocks in COST_OPS:
        n = int(sum(counters.get(b, 0) for b in blocks))
        if n:
            rows.append(CostRow(config, op, n, sum(counters.get(t, 0) for t in times) / n, None))
    return rows


def with_ratios(rows: Sequence[CostRow], prefill_us: float | None) -> list[CostRow]:
    """``rows`` and each config's combined ops (``COMBINED``: the sum of its parts' costs per
    block, over the blocks of the first), each with vLLM's prefill per block over its cost;
    a config's rows stay together, in the order the configs first appear."""
    out, by = list(rows), {(r.config, r.op): r for r in rows}
    order = list(dict.fromkeys(r.config for r in rows))
    for config in order:
        for op, first, second in COMBINED:
            a, b = by.get((config, first)), by.get((config, second))
            if a is not None and b is not None:
                out.append(CostRow(config, op, a.blocks, a.us_per_block + b.us_per_block, None))
    for r in out:
        if prefill_us is not None and r.us_per_block and r.us_per_block > 0:
            r.prefill_over_cost = prefill_us / r.us_per_block
    return sorted(out, key=lambda r: order.index(r.config))


def byte_row(config: str, counters: dict, full_bytes_per_token: int) -> ByteRow:
    """``counters`` (an engine's cumulative, ``vllm_engine``'s names) as a ``ByteRow``: the hit
    tokens are vLLM's count of the tokens the connector supplied (``EXTERNAL_HITS``; with
    vLLM's prefix caching off every cached token), the bytes the connector's ``loaded_bytes``
    (summed over tensor-parallel ranks, each loading its own shard). No hit: no ratio."""
    hit = int(counters.get(EXTERNAL_HITS, 0))
    loaded = int(counters.get("loaded_bytes", 0))
    per_token = loaded / hit if hit else None
    ratio = per_token / full_bytes_per_token if per_token is not None else None
    extra = {name: int(counters.get(name, 0)) for name in BLOCK_COUNTERS}
    return ByteRow(config, hit, loaded, per_token, full_bytes_per_token, ratio, **extra)


def median_byte_row(config: str, group: Sequence[ByteRow]) -> ByteRow:
    """The median over rounds of each figure of one configuration's rows."""

    def mid(name: str) -> float | None:
        values = [getattr(r, name) for r in group if getattr(r, name) is not None]
        return median(values) if values else None

    ints = ("hit_tokens", "loaded_bytes", *BLOCK_COUNTERS)
    return ByteRow(
        config, **{n: round(mid(n)) for n in ints}, bytes_per_token=mid("bytes_per_token"),
        full_bytes_per_token=group[0].full_bytes_per_token, ratio=mid("ratio"),
    )  # fmt: skip
