"""Real models' KV geometry as :class:`ModelPreset`s, for :meth:`TieredKVConfig.flat`.

A preset is the geometry only (layers, heads, dims, dtype, layer pattern) and a note saying
where the numbers come from (the model's public ``config.json``) and what the cache's
conventions cannot express exactly. It holds no weights: caches built from a preset are fed by
:class:`~tiered_kv.engine.synthetic_kv.SyntheticKV`, never by a model. ``scaled`` shrinks one
(fewer layers, narrower heads) for tests that still want its layer pattern.

Bytes are those this cache holds: KV in the preset's dtype, recurrent state in float32
(``MambaPool``'s dtype here; real engines often keep the conv history in bf16).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tiered_kv.config import ModelGeometry
from tiered_kv.engine.kv_bytes import KVBytes
from tiered_kv.errors import InvalidArgumentError


@dataclass(frozen=True)
class ModelPreset:
    """A model's KV geometry under the fields of :class:`ModelGeometry` (same defaults)."""

    name: str
    source: str  # one line: where the numbers come from, what is approximate
    model: str = "mha"
    num_layers: int = 4
    head_num: int = 2
    head_dim: int = 64
    v_head_dim: int | None = None
    kv_lora_rank: int = 64
    qk_rope_head_dim: int = 16
    index_head_dim: int = 128
    sliding_window: int = 64
    full_layer_every: int = 4
    conv_kernel: int = 4
    linear_heads: int = 2
    linear_key_dim: int = 16
    linear_value_dim: int = 32
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        self.to_geometry()  # the config's own checks, naming the field

    def to_geometry(self) -> ModelGeometry:
        return ModelGeometry(**geometry(self))


_GEOMETRY_FIELDS = tuple(
    f.name for f in dataclasses.fields(ModelPreset) if f.name not in ("name", "source")
)


def preset(name: str) -> ModelPreset:
    """The preset called ``name``; InvalidArgumentError listing the valid names otherwise."""
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise InvalidArgumentError(
            f"unknown model preset {name!r}; use one of {', '.join(PRESETS)}"
        ) from None


def geometry(p: ModelPreset) -> dict[str, object]:
    """The preset's geometry fields, for ``TieredKVConfig.flat(**geometry(p), ...)``."""
    return {f: getattr(p, f) for f in _GEOMETRY_FIELDS}


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            "llama-3-8b",
            "meta-llama/Meta-Llama-3-8B config.json: 32 layers, 8 KV heads x 128 (GQA), bf16",
            model="mha", num_layers=32, head_num=8, head_dim=128,
        ),
        ModelPreset(
            "qwen2.5-7b",
            "Qwen/Qwen2.5-7B config.json: 28 layers, 4 KV heads x 128 (hidden 3584 / 28 heads)",
            model="mha", num_layers=28, head_num=4, head_dim=128,
        ),
        ModelPreset(
            "deepseek-v3",
            "deepseek-ai/DeepSeek-V3 config.json: 61 layers of MLA, kv_lora_rank 512 + "
            "qk_rope_head_dim 64 = 576 elements per token and layer, bf16 (no fp8 KV)",
            model="mla", num_layers=61, kv_lora_rank=512, qk_rope_head_dim=64,
        ),
        ModelPreset(
            "deepseek-v3.2",
            "deepseek-ai/DeepSeek-V3.2-Exp config.json: DeepSeek-V3's MLA plus the sparse "
            "indexer's 128-element key per token and layer (fp8 + a float32 scale per block)",
            model="dsa", num_layers=61, kv_lora_rank=512, qk_rope_head_dim=64,
            index_head_dim=128,
        ),
        ModelPreset(
            "gemma-2-9b",
            "google/gemma-2-9b config.json: 42 layers, 8 KV heads x 256, window 4096, "
            "alternating; approximate: Gemma 2's even layers are the window ones, here layer "
            "i is full iff i % 2 == 0 (the config's SWA rule), so the halves swap (21 each)",
            model="swa", num_layers=42, head_num=8, head_dim=256, sliding_window=4096,
            full_layer_every=2,
        ),
        ModelPreset(
            "gemma-3-12b",
            "google/gemma-3-12b-it config.json (text_config): 48 layers, 8 KV heads x 256, "
            "bf16, sliding_window 1024, sliding_window_pattern 6 (5 local : 1 global); "
            "approximate: Gemma 3's global layers are (i + 1) % 6 == 0 (5, 11, ..., 47), here "
            "layer i is full iff i % 6 == 0 (0, 6, ..., 42; the config's SWA rule): the same "
            "8 full and 40 window layers, shifted",
            model="swa", num_layers=48, head_num=8, head_dim=256, sliding_window=1024,
            full_layer_every=6,
        ),
        ModelPreset(
            "gemma-3-4b",
            "google/gemma-3-4b-it config.json (text_config): 34 layers, 4 KV heads x 256, "
            "bf16, sliding_window 1024, sliding_window_pattern 6; approximate: Gemma 3's 5 "
            "global layers are (i + 1) % 6 == 0, here layer i is full iff i % 6 == 0 (the "
            "config's SWA rule): 6 full and 28 window layers, one window layer too few",
            model="swa", num_layers=34, head_num=4, head_dim=256, sliding_window=1024,
            full_layer_every=6,
        ),
        ModelPreset(
            "qwen3-next-80b-a3b",
            "Qwen/Qwen3-Next-80B-A3B config.json: 48 layers, full attention every 4th "
            "((i + 1) % 4 == 0) with 2 KV heads x 256, Gated DeltaNet elsewhere (conv kernel "
            "4; 16 key heads x 128, 32 value heads x 128); approximate: the config has one "
            "head count, so 16 heads of key 128 x value 256 (two value heads per key head: "
            "the same conv channels 8192 and state elements 524288 per layer)",
            model="hybrid_linear", num_layers=48, head_num=2, head_dim=256,
            full_layer_every=4, conv_kernel=4, linear_heads=16, linear_key_dim=128,
            linear_value_dim=256,
        ),
    )
}  # fmt: skip


def scaled(p: ModelPreset, layers: int | None = None, **changes: object) -> ModelPreset:
    """A smaller copy of ``p`` for tests: ``layers`` layers (the same layer pattern: a hybrid
    needs at least ``full_layer_every``) and any other geometry field changed (``head_dim=16``,
    ``linear_key_dim=8``, ...). Raises InvalidArgumentError naming a field that is not
    geometry or a value the config refuses."""
    unknown = sorted(set(changes) - set(_GEOMETRY_FIELDS))
    if unknown:
        raise InvalidArgumentError(
            f"scaled() got {unknown}; geometry fields are {', '.join(_GEOMETRY_FIELDS)}"
        )
    if layers is not None:
        changes["num_layers"] = layers
    note = ", ".join(f"{k}={v}" for k, v in changes.items())
    return dataclasses.replace(p, name=f"{p.name}[{note}]", **changes)


def kv_bytes(p: ModelPreset, page_size: int = 1) -> KVBytes:
    """The byte arithmetic of ``p``'s geometry (``kv_bytes.KVBytes``)."""
    return KVBytes(p.to_geometry(), page_size)


def kv_layer_ids(p: ModelPreset) -> list[int]:
    """The layers that keep per-token KV (all but a hybrid's recurrent ones)."""
    b = kv_bytes(p)
    return sorted(b.full_layers + b.window_layers)


def bytes_per_token(p: ModelPreset) -> int:
    """KV bytes one token writes over every layer that keeps KV, as this cache stores them (a
    DSA model's indexer key with its scales included; an SWA model's window layers counted,
    though they keep only the last ``sliding_window`` tokens)."""
    return kv_bytes(p).per_token


def state_bytes(p: ModelPreset) -> int:
    """A hybrid model's recurrent state per request (conv history plus temporal state of every
    recurrent layer, float32); 0 for a model without recurrent layers."""
    return kv_bytes(p).state
