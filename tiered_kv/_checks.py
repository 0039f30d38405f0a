"""Argument checks shared by the pools: each raises InvalidArgumentError naming the value."""

from __future__ import annotations

import torch

from tiered_kv.errors import InvalidArgumentError

INDEX_DTYPES = (torch.int32, torch.int64)


def check_positive_int(name: str, value: object, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{name}={value!r} is invalid; expected an int >= {minimum}")
    return value


def check_index_tensor(
    name: str,
    t: object,
    device: torch.device | None,
    *,
    dtypes: tuple[torch.dtype, ...] = INDEX_DTYPES,
) -> torch.Tensor:
    """A 1-D integer tensor on ``device`` (None: any device)."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise InvalidArgumentError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise InvalidArgumentError(f"{name} has dtype {t.dtype}; expected one of {allowed}")
    if device is not None and not same_device(t.device, device):
        raise InvalidArgumentError(f"{name} is on {t.device}; expected it on {device}")
    return t


def same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cuda":
        ia = a.index if a.index is not None else torch.cuda.current_device()
        ib = b.index if b.index is not None else torch.cuda.current_device()
        return ia == ib
    return True


def check_range(name: str, t: torch.Tensor, low: int, high: int) -> None:
    """Every element in [low, high). Reads the values: a device sync on CUDA."""
    if t.numel() == 0:
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < low or hi >= high:
        bad = t[(t < low) | (t >= high)][:8].tolist()
        raise InvalidArgumentError(
            f"{name} has values {bad} outside the valid range [{low}, {high})"
        )
