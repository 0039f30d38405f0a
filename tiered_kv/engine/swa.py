"""The sliding-window variant of the reference model (Gemma / gpt-oss style layer patterns).

Layer i is full attention when ``i % full_layer_every == 0`` and a window layer otherwise: a
query there attends to the last ``sliding_window`` positions only (its own included). The cache
keeps the two kinds in the two sub-pools of an ``SWAKVPool``; everything else is
:class:`TinyLlama`'s, so KV restored into both sub-pools gives bitwise-equal logits, and a
window layer's KV of a token that left every query's window cannot change them.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiered_kv._checks import check_positive_int
from tiered_kv.engine.model import ModelConfig, TinyLlama
from tiered_kv.errors import InvalidArgumentError


@dataclass(frozen=True)
class SWAModelConfig(ModelConfig):
    sliding_window: int = 64
    full_layer_every: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("sliding_window", self.sliding_window)
        check_positive_int("full_layer_every", self.full_layer_every, minimum=2)
        if self.num_layers < 2:
            raise InvalidArgumentError(
                f"num_layers={self.num_layers}: a sliding-window model needs a full layer and a "
                "window layer"
            )

    def is_window_layer(self, layer: int) -> bool:
        return layer % self.full_layer_every != 0


class TinySWA(TinyLlama):
    cfg: SWAModelConfig

    def __init__(self, cfg: SWAModelConfig) -> None:
        if not isinstance(cfg, SWAModelConfig):
            raise InvalidArgumentError(f"TinySWA needs an SWAModelConfig, got {type(cfg).__name__}")
        super().__init__(cfg)

    def _window(self, layer: int) -> int | None:
        return self.cfg.sliding_window if self.cfg.is_window_layer(layer) else None
