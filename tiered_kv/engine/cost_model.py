"""CostModel: *modeled* compute time for synthetic-KV runs, where no model runs.

A run whose KV comes from :class:`~tiered_kv.engine.synthetic_kv.SyntheticKV` moves real bytes
between tiers but computes nothing; the time its prefill and decode would take on a named
accelerator comes from here, from stated throughput figures, and every number derived from it
must be reported as modeled (``CostModel.label``). The tiny reference models keep measured
times and end-to-end logit checks.

The figures below are estimates from public specifications, not measurements: prefill at a
stated fraction of the accelerator's dense bf16 FLOP/s (2 x parameters FLOPs per token), decode
one step per batch at a stated fraction of HBM bandwidth for reading the weights, plus the KV
the batch reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tiered_kv.errors import InvalidArgumentError


def _positive(name: str, value: object, *, zero_ok: bool = False) -> None:
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value >= 0 if zero_ok else value > 0)
    )
    if not ok:
        bound = ">= 0" if zero_ok else "> 0"
        raise InvalidArgumentError(
            f"CostModel.{name}={value!r} is invalid: a finite number {bound}"
        )


@dataclass(frozen=True)
class CostModel:
    """``prefill_s(tokens) = tokens / prefill_tokens_per_s``;
    ``decode_s(batch, kv_bytes) = decode_step_s + batch * decode_per_seq_s
    + kv_bytes / kv_read_bytes_per_s`` (the last term only when ``kv_read_bytes_per_s``)."""

    name: str
    prefill_tokens_per_s: float
    decode_step_s: float  # one decode step of any batch: the weights read once
    decode_per_seq_s: float = 0.0  # added per sequence in the batch
    kv_read_bytes_per_s: float = 0.0  # the KV a step reads, at this rate (0: not modeled)
    source: str = ""  # where the numbers come from

    label = "modeled"  # every time from here is modeled, never measured

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgumentError(f"CostModel.name={self.name!r} must be a non-empty str")
        _positive("prefill_tokens_per_s", self.prefill_tokens_per_s)
        _positive("decode_step_s", self.decode_step_s)
        _positive("decode_per_seq_s", self.decode_per_seq_s, zero_ok=True)
        _positive("kv_read_bytes_per_s", self.kv_read_bytes_per_s, zero_ok=True)

    def prefill_s(self, tokens: int) -> float:
        """Modeled seconds to prefill ``tokens`` tokens (>= 0)."""
        _count("tokens", tokens)
        return tokens / self.prefill_tokens_per_s

    def decode_s(self, batch: int, kv_bytes: int = 0) -> float:
        """Modeled seconds of one decode step of ``batch`` (>= 1) sequences reading
        ``kv_bytes`` of KV in all (ignored when ``kv_read_bytes_per_s`` is 0)."""
        _count("batch", batch, minimum=1)
        _count("kv_bytes", kv_bytes)
        t = self.decode_step_s + batch * self.decode_per_seq_s
        if self.kv_read_bytes_per_s:
            t += kv_bytes / self.kv_read_bytes_per_s
        return t


def _count(name: str, value: object, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{name}={value!r} must be an int >= {minimum}")


COST_MODELS: dict[str, CostModel] = {
    m.name: m
    for m in (
        CostModel(
            "h100-llama-3-8b",
            prefill_tokens_per_s=30_000.0,
            decode_step_s=0.0064,
            kv_read_bytes_per_s=2.5e12,
            source="modeled: H100 SXM 989 TFLOP/s dense bf16 at ~50% MFU / 16 GFLOP per token "
            "(8.0B params) ~ 30k tokens/s; decode reads 16 GB of bf16 weights at ~75% of "
            "3.35 TB/s HBM3 (~2.5 TB/s) = 6.4 ms per step, KV at the same rate",
        ),
        CostModel(
            "h200-qwen2.5-7b",
            prefill_tokens_per_s=32_000.0,
            decode_step_s=0.0042,
            kv_read_bytes_per_s=3.6e12,
            source="modeled: H200 989 TFLOP/s dense bf16 at ~50% MFU / 15.2 GFLOP per token "
            "(7.6B params) ~ 32k tokens/s; 15.2 GB of weights at ~75% of 4.8 TB/s HBM3e "
            "(~3.6 TB/s) = 4.2 ms per step, KV at the same rate",
        ),
        CostModel(
            "h100-gemma-3-12b",
            prefill_tokens_per_s=21_000.0,
            decode_step_s=0.0094,
            kv_read_bytes_per_s=2.5e12,
            source="modeled: H100 SXM 989 TFLOP/s dense bf16 at ~50% MFU / 23.5 GFLOP per token "
            "(11.8B text params) ~ 21k tokens/s; 23.5 GB of bf16 weights at ~2.5 TB/s (75% of "
            "3.35 TB/s) = 9.4 ms per step, KV at the same rate",
        ),
        CostModel(
            "h100-gemma-3-4b",
            prefill_tokens_per_s=63_000.0,
            decode_step_s=0.0031,
            kv_read_bytes_per_s=2.5e12,
            source="modeled: H100 SXM 989 TFLOP/s dense bf16 at ~50% MFU / 7.8 GFLOP per token "
            "(3.9B text params) ~ 63k tokens/s; 7.8 GB of bf16 weights at ~2.5 TB/s = 3.1 ms "
            "per step, KV at the same rate",
        ),
        CostModel(
            "h200x2-qwen3-next-80b-a3b",
            prefill_tokens_per_s=82_000.0,
            decode_step_s=0.004,
            decode_per_seq_s=0.00083,
            kv_read_bytes_per_s=5.4e12,
            source="modeled: 2 x H200 (160 GB of bf16 weights need two) at ~25% of 2 x 989 "
            "TFLOP/s (MoE and linear-attention kernels) / 6 GFLOP per token (3B active) ~ 82k "
            "tokens/s; decode 4 ms per step plus each sequence's own 3B active params (6 GB) "
            "at ~7.2 TB/s = 0.83 ms, KV and state at 75% of 2 x 3.6 TB/s",
        ),
        CostModel(
            "h800x8-deepseek-v3",
            prefill_tokens_per_s=73_700.0,
            decode_step_s=0.05,
            source="modeled: DeepSeek's published inference-system figures (open-infra-index, "
            "day 6): 73.7k input tokens/s per 8 x H800 node in prefill (cache hits included, "
            "so optimistic), ~20 tokens/s per user in decode (50 ms a step)",
        ),
    )
}


def cost_model(name: str) -> CostModel:
    """The named cost model; InvalidArgumentError listing the valid names otherwise."""
    try:
        return COST_MODELS[name]
    except (KeyError, TypeError):
        raise InvalidArgumentError(
            f"unknown cost model {name!r}; use one of {', '.join(COST_MODELS)}"
        ) from None
