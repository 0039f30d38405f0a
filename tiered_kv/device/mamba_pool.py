"""MambaPool: the per-slot recurrent state of a hybrid model's linear-attention layers.

A Mamba / gated-linear layer keeps no per-token KV, only a fixed-size state per request: the
short-convolution history ``conv`` (one tensor per layer, because layers may differ in kernel
width) and the recurrent SSM state ``temporal``. Both are indexed by *slot*, handed out by
``MambaSlotAllocator``: buffer row ``s`` is slot ``s``; row 0 is the padding row padded batches
read and write; rows ``size + 1 ..`` are speculative draft slots.

Sibling states (a short-conv pool, an n-gram pool, anything addressed by the same slot) are
registered with :meth:`MambaPool.register_slot_state` and ride along on every ``clear_slots``
and ``copy_from``, and are declared beside this pool for the host tier: a slot never changes
owner with a stale sibling row attached (recurrent state leaking across requests gives silently
wrong outputs, no crash).

The pool owns bytes only; who owns which slot is the allocator's and the request pool's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tiered_kv import platform
from tiered_kv._checks import check_index_tensor, check_positive_int, same_device
from tiered_kv.device.state_decl import StatePart, StatePoolDecl
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.hugepages import empty_zeroed


@dataclass(frozen=True)
class State:
    """Recurrent state tensors. For the whole pool: ``conv[i]`` ``(rows, *conv_shape_i)`` and
    ``temporal`` ``(layers, rows, *temporal_shape)``; for one layer (``layer_cache``):
    ``conv == [that layer's (rows, *conv_shape)]`` and ``temporal`` ``(rows, *temporal_shape)``.
    The tensors are the pool's own: writing them writes the pool."""

    conv: list[torch.Tensor]
    temporal: torch.Tensor

    def mem_usage_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.conv, self.temporal))


# -- checks shared with the sibling pools -------------------------------------------------
def state_shape(name: str, value: object) -> tuple[int, ...]:
    """A non-empty tuple of ints >= 1."""
    try:
        out = tuple(value)  # type: ignore[arg-type]
    except TypeError:
        out = None
    if not out or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in out):
        raise InvalidArgumentError(f"{name}={value!r} must be a non-empty tuple of ints >= 1")
    return out


def layer_id_list(name: str, ids: object, *, allow_empty: bool = False) -> tuple[int, ...]:
    """Distinct global layer ids (ints >= 0)."""
    try:
        out = tuple(ids)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(f"{name} must be a sequence of layer ids, got {ids!r}") from None
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in out) or (
        not out and not allow_empty
    ):
        raise InvalidArgumentError(f"{name}={list(out)!r} must be a non-empty list of ints >= 0")
    if len(set(out)) != len(out):
        raise InvalidArgumentError(f"{name}={list(out)!r} lists a layer twice")
    return out


def float_dtype(name: str, dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidArgumentError(
            f"{name}={dtype!r} must be a floating torch dtype (torch.float32, bfloat16, ...)"
        )
    return dtype


def state_slots(
    name: str, slots: object, device: torch.device, num_rows: int, *, read_values: bool
) -> torch.Tensor:
    """``slots`` as int64, after checking it is 1-D integer on ``device`` and (when
    ``read_values``: a device sync on CUDA) every value a real slot ``1 .. num_rows - 1``."""
    t = check_index_tensor(name, slots, device)
    if read_values and t.numel():
        bad = t[(t < 1) | (t >= num_rows)]
        if bad.numel():
            raise InvalidArgumentError(
                f"{name} holds {bad[:8].tolist()}; valid slots are 1..{num_rows - 1} "
                "(slot 0 is the padding row)"
            )
    return t.to(torch.int64)


def copy_slot_pair(
    src: object, dst: object, device: torch.device, num_rows: int, *, read_values: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked (src, dst) for a row copy: equal lengths, valid slots, no destination twice."""
    s = state_slots("src_slots", src, device, num_rows, read_values=read_values)
    d = state_slots("dst_slots", dst, device, num_rows, read_values=read_values)
    if s.shape != d.shape:
        raise InvalidArgumentError(
            f"src_slots has {s.shape[0]} slots and dst_slots {d.shape[0]}; they pair one to one"
        )
    if read_values and torch.unique(d).numel() != d.numel():
        raise InvalidArgumentError(f"dst_slots {d[:16].tolist()} repeat a destination")
    return s, d


class MambaPool:
    """``conv[i]`` ``(rows, *conv_shapes[i])`` per Mamba layer and ``temporal``
    ``(layers, rows, *temporal_shape)``, ``rows = size + spec_state_size + 1``; zero-filled.

    Layer ids are global (``mamba_layer_ids``; ``mamba_map`` turns one into its dense index).
    Slot values are range-checked on CPU always and on CUDA in debug mode (a device sync)."""

    State = State

    def __init__(
        self,
        *,
        size: int,
        spec_state_size: int = 0,
        conv_shapes: Sequence[tuple[int, ...]],
        temporal_shape: tuple[int, ...],
        mamba_layer_ids: Sequence[int],
        conv_dtype: torch.dtype = torch.float32,
        temporal_dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
        debug_mode: bool | None = None,
    ) -> None:
        self.size = check_positive_int("size", size)
        self.spec_state_size = check_positive_int("spec_state_size", spec_state_size, minimum=0)
        self.mamba_layer_ids = layer_id_list("mamba_layer_ids", mamba_layer_ids)
        try:
            shapes = [state_shape(f"conv_shapes[{i}]", s) for i, s in enumerate(conv_shapes)]
        except TypeError:
            raise InvalidArgumentError(f"conv_shapes={conv_shapes!r} must be a list") from None
        if len(shapes) != len(self.mamba_layer_ids):
            raise InvalidArgumentError(
                f"conv_shapes has {len(shapes)} shapes for {len(self.mamba_layer_ids)} Mamba "
                f"layers {list(self.mamba_layer_ids)}; give one per layer"
            )
        self.conv_shapes = tuple(shapes)
        self.temporal_shape = state_shape("temporal_shape", temporal_shape)
        self.conv_dtype = float_dtype("conv_dtype", conv_dtype)
        self.temporal_dtype = float_dtype("temporal_dtype", temporal_dtype)
        self.device = platform.resolve_device(device)
        self.debug_mode = platform.debug_mode() if debug_mode is None else bool(debug_mode)
        self.num_rows = self.size + self.spec_state_size + 1
        self.num_mamba_layers = len(self.mamba_layer_ids)
        self.mamba_map = {g: i for i, g in enumerate(self.mamba_layer_ids)}
        rows = self.num_rows
        self.conv = [empty_zeroed((rows, *s), self.conv_dtype, self.device) for s in shapes]
        self.temporal = empty_zeroed(
            (self.num_mamba_layers, rows, *self.temporal_shape), self.temporal_dtype, self.device
        )
        self.mamba_cache = State(conv=self.conv, temporal=self.temporal)
        self._siblings: list[Any] = []

    # -- layers -----------------------------------------------------------------------------
    def layer_index(self, layer_id: int) -> int:
        """Dense index of global ``layer_id``; InvalidArgumentError for a non-Mamba layer."""
        try:
            return self.mamba_map[layer_id]
        except (KeyError, TypeError):
            raise InvalidArgumentError(
                f"layer_id={layer_id!r} is not a Mamba layer of this pool; its layers are "
                f"{list(self.mamba_layer_ids)}"
            ) from None

    def layer_cache(self, layer_id: int) -> State:
        """The state of global layer ``layer_id`` (views of the pool's buffers)."""
        i = self.layer_index(layer_id)
        return State(conv=[self.conv[i]], temporal=self.temporal[i])

    # -- siblings ---------------------------------------------------------------------------
    @property
    def slot_states(self) -> tuple[Any, ...]:
        return tuple(self._siblings)

    def check_slot_state(self, state: Any) -> None:
        """Raise InvalidArgumentError if ``register_slot_state(state)`` would refuse it."""
        missing = [
            a
            for a in ("clear_slots", "copy_from", "state_decl", "enabled", "num_rows", "device")
            if not hasattr(state, a)
        ]
        kind = type(state).__name__
        if missing:
            raise InvalidArgumentError(f"{kind} is not a slot state: it lacks {missing}")
        if not state.enabled:
            raise InvalidArgumentError(
                f"{kind} is disabled (it has no buffers); register only enabled slot states"
            )
        if state.num_rows != self.num_rows or not same_device(state.device, self.device):
            raise InvalidArgumentError(
                f"{kind} has {state.num_rows} rows on {state.device}; this pool has "
                f"{self.num_rows} rows (size + spec_state_size + 1) on {self.device}"
            )
        if any(s is state for s in self._siblings):
            raise InvalidArgumentError(f"this {kind} is already registered")
        names = [d.name for d in (self.state_decl(), *(s.state_decl() for s in self._siblings))]
        if state.state_decl().name in names:
            raise InvalidArgumentError(
                f"a slot state named {state.state_decl().name!r} is already declared ({names})"
            )

    def register_slot_state(self, state: Any) -> None:
        """Attach ``state`` (``clear_slots``, ``copy_from``, ``state_decl``, ``enabled``,
        ``num_rows``, ``device``) so every slot operation here applies to it too. It must be
        enabled, have this pool's rows and device, and a declaration name of its own."""
        self.check_slot_state(state)
        self._siblings.append(state)

    # -- slot operations ----------------------------------------------------------------------
    @property
    def _read_values(self) -> bool:
        return self.device.type == "cpu" or self.debug_mode

    def clear_slots(self, slots: torch.Tensor) -> None:
        """Zero rows ``slots`` of every buffer and of every registered sibling (which resets
        them to its own initial value). Validates first; on error nothing changes."""
        idx = state_slots("slots", slots, self.device, self.num_rows, read_values=self._read_values)
        few = self._few(idx)
        if few is not None:  # row views: no index kernels (10x faster for one slot on CPU)
            for r in few:
                for c in self.conv:
                    c[r].zero_()
                self.temporal[:, r].zero_()
        else:
            for c in self.conv:
                c.index_fill_(0, idx, 0)
            self.temporal.index_fill_(1, idx, 0)
        for s in self._siblings:
            s.clear_slots(idx)

    def copy_from(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Row ``src_slots[i]`` -> row ``dst_slots[i]`` in every buffer and sibling, bit for bit.
        Overlapping sources and destinations read the rows as they were before the call."""
        src, dst = copy_slot_pair(
            src_slots, dst_slots, self.device, self.num_rows, read_values=self._read_values
        )
        few_src, few_dst = self._few(src), self._few(dst)
        if few_src is not None and few_dst is not None and not set(few_src) & set(few_dst):
            for a, b in zip(few_src, few_dst, strict=True):  # row views, as in clear_slots
                for c in self.conv:
                    c[b].copy_(c[a])
                self.temporal[:, b].copy_(self.temporal[:, a])
        else:
            for c in self.conv:
                c[dst] = c[src]
            self.temporal[:, dst] = self.temporal[:, src]
        for s in self._siblings:
            s.copy_from(src, dst)

    def _few(self, idx: torch.Tensor) -> list[int] | None:
        """A few slots on a CPU pool as ints (reading them is free there), else None."""
        if self.device.type != "cpu" or idx.numel() > 8:
            return None
        return idx.tolist()

    # -- host tier ----------------------------------------------------------------------------
    def state_decl(self) -> StatePoolDecl:
        """This pool's own parts (siblings declare theirs): per layer ``conv.L<g>`` and
        ``temporal.L<g>``, each a ``(num_rows, *slot_shape)`` buffer."""
        parts = []
        for i, g in enumerate(self.mamba_layer_ids):
            parts.append(
                StatePart(
                    f"conv.L{g}", self.conv_shapes[i], self.conv_dtype, lambda i=i: self.conv[i]
                )
            )
            parts.append(
                StatePart(
                    f"temporal.L{g}",
                    self.temporal_shape,
                    self.temporal_dtype,
                    lambda i=i: self.temporal[i],
                )
            )
        return StatePoolDecl(
            name="mamba", kind="mamba", owner=self, parts=tuple(parts), num_rows=self.num_rows
        )

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one slot in this pool's buffers (siblings not included)."""
        return self.state_decl().slot_nbytes

    def mem_usage_bytes(self) -> int:
        """Bytes this pool's buffers hold on the device, padding and draft rows included."""
        return self.mamba_cache.mem_usage_bytes()
