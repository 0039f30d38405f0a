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
from tiered_kv.device.dsa_pool import QUANT_BLOCK
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import ModelKind

STATE_DTYPE_BYTES = 4  # MambaPool keeps conv and temporal state in float32


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


def _dtype_bytes(p: ModelPreset) -> int:
    return p.to_geometry().torch_dtype.itemsize


def kv_layer_ids(p: ModelPreset) -> list[int]:
    """The layers that keep per-token KV (all but a hybrid's recurrent ones)."""
    g = p.to_geometry()
    if g.model == ModelKind.HYBRID_LINEAR:
        return g.hybrid_layer_ids()[0]
    return list(range(g.num_layers))


def bytes_per_token(p: ModelPreset) -> int:
    """KV bytes one token writes over every layer that keeps KV, as this cache stores them (a
    DSA model's indexer key with its scales included; an SWA model's window layers counted,
    though they keep only the last ``sliding_window`` tokens)."""
    g, b = p.to_geometry(), _dtype_bytes(p)
    layers = len(kv_layer_ids(p))
    if g.model in (ModelKind.MLA, ModelKind.DSA):
        per_layer = (g.kv_lora_rank + g.qk_rope_head_dim) * b
        if g.model == ModelKind.DSA:
            per_layer += g.index_head_dim + 4 * (g.index_head_dim // QUANT_BLOCK)
        return layers * per_layer
    return layers * g.head_num * (g.head_dim + (g.v_head_dim or g.head_dim)) * b


def state_bytes(p: ModelPreset) -> int:
    """A hybrid model's recurrent state per request (conv history plus temporal state of every
    recurrent layer, float32); 0 for a model without recurrent layers."""
    g = p.to_geometry()
    if g.model != ModelKind.HYBRID_LINEAR:
        return 0
    conv, (h, dk, dv) = g.conv_state_shape(), g.temporal_state_shape()
    per_layer = conv[0] * conv[1] + h * dk * dv
    return len(g.hybrid_layer_ids()[1]) * per_layer * STATE_DTYPE_BYTES
