"""HostPoolDecl: what a device-side owner of bytes declares it needs kept on the host.

Every owner of device bytes (a KV pool now; later a recurrent-state pool or a DSA indexer cache)
describes its buffers here, and the host tier builds its pools from these declarations only, so
nothing outside the owner guesses a shape. A declaration lists *parts* (K and V of an MHA pool,
the single latent of an MLA pool); each part is a row of ``elems`` elements per token and layer,
read from the owner's per-layer buffer of ``num_slots`` rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch


@dataclass(frozen=True)
class HostPart:
    """One per-token row of the owner's buffers, e.g. K ``(head_num, head_dim)``."""

    name: str
    item_shape: tuple[int, ...]
    # buffer(local_layer) -> the owner's (num_slots, *item_shape) tensor in store dtype.
    buffer: Callable[[int], torch.Tensor] = field(repr=False, compare=False)

    @property
    def elems(self) -> int:
        return prod(self.item_shape)


@dataclass(frozen=True)
class HostPoolDecl:
    """A host pool the owner needs: its name, the owner, the parts of one token-layer record,
    the element dtype as stored, and the global layer ids it covers."""

    name: str
    kind: str
    device_pool: Any = field(repr=False, compare=False)
    parts: tuple[HostPart, ...]
    dtype: torch.dtype
    layer_ids: tuple[int, ...]
    page_size: int
    num_slots: int

    @property
    def layer_num(self) -> int:
        return len(self.layer_ids)

    @property
    def elems_per_token_per_layer(self) -> int:
        return sum(p.elems for p in self.parts)

    @property
    def bytes_per_token_per_layer(self) -> int:
        return self.elems_per_token_per_layer * torch.empty((), dtype=self.dtype).element_size()

    @property
    def device(self) -> torch.device:
        return self.device_pool.device

    @property
    def size(self) -> int:
        """Usable device slots of the owner (its padding page excluded)."""
        return self.num_slots - self.page_size
