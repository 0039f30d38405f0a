"""StatePoolDecl: what a device owner of per-request state declares it needs kept on the host.

Recurrent layers (Mamba, gated linear attention, short convolutions) and n-gram draft pools keep
no per-token KV: each request slot holds a fixed-size state. Its owner (the request pool, not a
KV pool: the seed's "who owns the buffer declares its host copy") describes that state here,
one *part* per tensor: a part is the ``slot_shape`` row of slot ``s`` in the owner's
``(num_rows, *slot_shape)`` buffer. The host tier builds its state slots from declarations
only, so nothing outside the owner guesses a shape, and a snapshot of slot ``s`` is every part's
row ``s``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch


@dataclass(frozen=True)
class StatePart:
    """One tensor of a slot's state, e.g. the conv history of one Mamba layer ``(dim, k-1)``."""

    name: str
    slot_shape: tuple[int, ...]
    dtype: torch.dtype
    # buffer() -> the owner's (num_rows, *slot_shape) tensor; row s is slot s.
    buffer: Callable[[], torch.Tensor] = field(repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        """Bytes of this part in one slot."""
        return prod(self.slot_shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class StatePoolDecl:
    """A state pool the owner needs kept on the host: its name and kind (``mamba``,
    ``short_conv``, ``ngram``), the owner, its parts, and the owner's row count (row 0 is
    padding; usable slots are ``1 .. num_rows - 1``)."""

    name: str
    kind: str
    owner: Any = field(repr=False, compare=False)
    parts: tuple[StatePart, ...]
    num_rows: int

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one slot's state, every part."""
        return sum(p.nbytes for p in self.parts)

    @property
    def device(self) -> torch.device:
        return self.parts[0].buffer().device
