"""Sibling slot states: per-request state addressed by a request's Mamba slot.

Registered on a :class:`~tiered_kv.device.mamba_pool.MambaPool` (``register_slot_state``),
they are cleared and copied with its rows and declared beside it for the host tier, so a slot
that changes owner carries no stale sibling row. Same row layout as the Mamba pool: row ``s``
is slot ``s``, row 0 is padding, ``size + spec_state_size + 1`` rows.

- ``ShortConvPool``: one short-convolution history per short-conv layer per slot (models with
  short convolutions outside their Mamba layers); enabled iff it has layers.
- ``NGramPool``: the last ``context_len`` token ids of each slot (oldest first, ``eos`` before
  the first token) and the count of tokens pushed since the slot was cleared; enabled iff
  ``context_len > 0``.

A disabled pool holds no buffers: its slot operations are no-ops, and asking it for a buffer or
a declaration is a LayoutError.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from tiered_kv import platform
from tiered_kv._checks import check_positive_int
from tiered_kv.device.mamba_pool import (
    copy_slot_pair,
    float_dtype,
    layer_id_list,
    state_shape,
    state_slots,
)
from tiered_kv.device.state_decl import StatePart, StatePoolDecl
from tiered_kv.errors import InvalidArgumentError, LayoutError
from tiered_kv.hugepages import empty_zeroed


class _SlotRows(abc.ABC):
    """Rows ``0 .. size + spec_state_size`` on one device, and the slot checks; each pool
    declares its own parts (``state_decl``)."""

    def __init__(
        self,
        size: int,
        spec_state_size: int,
        device: str | torch.device | None,
        debug_mode: bool | None,
    ) -> None:
        self.size = check_positive_int("size", size)
        self.spec_state_size = check_positive_int("spec_state_size", spec_state_size, minimum=0)
        self.num_rows = self.size + self.spec_state_size + 1
        self.device = platform.resolve_device(device)
        self.debug_mode = platform.debug_mode() if debug_mode is None else bool(debug_mode)

    enabled = False

    def _slots(self, slots: object) -> torch.Tensor:
        read = self.device.type == "cpu" or self.debug_mode
        return state_slots("slots", slots, self.device, self.num_rows, read_values=read)

    def _pair(self, src: object, dst: object) -> tuple[torch.Tensor, torch.Tensor]:
        read = self.device.type == "cpu" or self.debug_mode
        return copy_slot_pair(src, dst, self.device, self.num_rows, read_values=read)

    def _need_enabled(self, what: str) -> None:
        if not self.enabled:
            raise LayoutError(f"this {type(self).__name__} is disabled: it has no {what}")

    @property
    def slot_nbytes(self) -> int:
        return self.state_decl().slot_nbytes if self.enabled else 0

    @abc.abstractmethod
    def state_decl(self) -> StatePoolDecl:
        """This pool's parts for the host tier."""


class ShortConvPool(_SlotRows):
    """``conv_state`` ``(layers, rows, *state_shape)``, zero-filled; ``layer_cache(g)`` is the
    ``(rows, *state_shape)`` history of global layer ``g``."""

    def __init__(
        self,
        *,
        size: int,
        spec_state_size: int = 0,
        state_shape: tuple[int, ...] | None,
        layer_ids: Sequence[int],
        dtype: torch.dtype,
        device: str | torch.device | None = None,
        debug_mode: bool | None = None,
    ) -> None:
        super().__init__(size, spec_state_size, device, debug_mode)
        self.layer_ids = layer_id_list("layer_ids", layer_ids, allow_empty=True)
        self.layer_map = {g: i for i, g in enumerate(self.layer_ids)}
        self.conv_state: torch.Tensor | None = None
        self.state_shape: tuple[int, ...] | None = None
        if not self.layer_ids:
            return
        self.state_shape = _state_shape("state_shape", state_shape)
        self.dtype = float_dtype("dtype", dtype)
        self.conv_state = empty_zeroed(
            (len(self.layer_ids), self.num_rows, *self.state_shape), self.dtype, self.device
        )

    @property
    def enabled(self) -> bool:  # type: ignore[override]
        return self.conv_state is not None

    def layer_cache(self, layer_id: int) -> torch.Tensor:
        self._need_enabled("short-conv layers")
        try:
            i = self.layer_map[layer_id]
        except (KeyError, TypeError):
            raise InvalidArgumentError(
                f"layer_id={layer_id!r} is not a short-conv layer; its layers are "
                f"{list(self.layer_ids)}"
            ) from None
        return self.conv_state[i]  # type: ignore[index]

    def clear_slots(self, slots: torch.Tensor) -> None:
        """Zero rows ``slots`` of every layer (a no-op when disabled)."""
        idx = self._slots(slots)
        if self.conv_state is not None:
            self.conv_state.index_fill_(1, idx, 0)

    def copy_from(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        src, dst = self._pair(src_slots, dst_slots)
        if self.conv_state is not None:
            self.conv_state[:, dst] = self.conv_state[:, src]

    def state_decl(self) -> StatePoolDecl:
        self._need_enabled("state to declare")
        parts = tuple(
            StatePart(f"conv.L{g}", self.state_shape, self.dtype, lambda i=i: self.conv_state[i])
            for i, g in enumerate(self.layer_ids)
        )
        return StatePoolDecl("short_conv", "short_conv", self, parts, self.num_rows)

    def mem_usage_bytes(self) -> int:
        t = self.conv_state
        return 0 if t is None else t.numel() * t.element_size()


class NGramPool(_SlotRows):
    """``tokens`` ``(rows, context_len)`` int32 filled with ``eos_token_id`` and ``num_tokens``
    ``(rows, 1)`` int64: per slot the newest ``context_len`` token ids (oldest first) and how
    many tokens were pushed since the slot was last cleared."""

    def __init__(
        self,
        *,
        size: int,
        spec_state_size: int = 0,
        context_len: int,
        eos_token_id: int,
        device: str | torch.device | None = None,
        debug_mode: bool | None = None,
    ) -> None:
        super().__init__(size, spec_state_size, device, debug_mode)
        self.context_len = check_positive_int("context_len", context_len, minimum=0)
        self.eos_token_id = check_positive_int("eos_token_id", eos_token_id, minimum=0)
        if self.eos_token_id > torch.iinfo(torch.int32).max:
            raise InvalidArgumentError(f"eos_token_id={eos_token_id} does not fit in int32")
        self.tokens: torch.Tensor | None = None
        self.num_tokens: torch.Tensor | None = None
        if not self.context_len:
            return
        self.tokens = torch.full(
            (self.num_rows, self.context_len),
            self.eos_token_id,
            dtype=torch.int32,
            device=self.device,
        )
        self.num_tokens = empty_zeroed((self.num_rows, 1), torch.int64, self.device)

    @property
    def enabled(self) -> bool:  # type: ignore[override]
        return self.tokens is not None

    def push(self, slot: int, tokens: torch.Tensor | Sequence[int]) -> None:
        """Append ``tokens`` (1-D int) to slot ``slot``'s history, keeping the newest
        ``context_len``. Validates first; on error nothing changes."""
        self._need_enabled("token history")
        if isinstance(slot, bool) or not isinstance(slot, int) or not 1 <= slot < self.num_rows:
            raise InvalidArgumentError(f"slot={slot!r} must be an int in 1..{self.num_rows - 1}")
        t = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(list(tokens))
        if t.dim() != 1 or (t.numel() and t.is_floating_point()):
            raise InvalidArgumentError(
                f"tokens must be a 1-D sequence of int token ids, got shape {tuple(t.shape)}, "
                f"dtype {t.dtype}"
            )
        k = t.shape[0]
        if not k:
            return
        t = t.to(device=self.device, dtype=torch.int32)
        row = self.tokens[slot]  # type: ignore[index]
        n = self.context_len
        if k >= n:
            row.copy_(t[k - n :])
        else:
            row[: n - k] = row[k:].clone()
            row[n - k :] = t
        self.num_tokens[slot] += k  # type: ignore[index]

    def context(self, slots: torch.Tensor) -> torch.Tensor:
        """A copy of the histories of ``slots``: ``(len(slots), context_len)`` int32."""
        self._need_enabled("token history")
        return self.tokens.index_select(0, self._slots(slots))  # type: ignore[union-attr]

    def clear_slots(self, slots: torch.Tensor) -> None:
        """Reset rows ``slots`` to ``eos`` and a count of 0 (a no-op when disabled)."""
        idx = self._slots(slots)
        if self.tokens is not None:
            self.tokens.index_fill_(0, idx, self.eos_token_id)
            self.num_tokens.index_fill_(0, idx, 0)  # type: ignore[union-attr]

    def copy_from(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        src, dst = self._pair(src_slots, dst_slots)
        if self.tokens is not None:
            self.tokens[dst] = self.tokens[src]
            self.num_tokens[dst] = self.num_tokens[src]  # type: ignore[index]

    def state_decl(self) -> StatePoolDecl:
        self._need_enabled("state to declare")
        parts = (
            StatePart("tokens", (self.context_len,), torch.int32, lambda: self.tokens),
            StatePart("num_tokens", (1,), torch.int64, lambda: self.num_tokens),
        )
        return StatePoolDecl("ngram", "ngram", self, parts, self.num_rows)

    def mem_usage_bytes(self) -> int:
        if self.tokens is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.tokens, self.num_tokens))


def _state_shape(name: str, value: object) -> tuple[int, ...]:
    if value is None:
        raise InvalidArgumentError(f"{name} is None; a pool with layers needs its state shape")
    return state_shape(name, value)
