"""Argument checks shared by the pools: each raises InvalidArgumentError naming the value."""

from __future__ import annotations

import operator

import numpy as np
import torch

from tiered_kv.errors import InvalidArgumentError

INDEX_DTYPES = (torch.int32, torch.int64)


def check_positive_int(name: str, value: object, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{name}={value!r} is invalid; expected an int >= {minimum}")
    return value


def check_seconds(name: str, value: object) -> float:
    """A number of seconds >= 0 (inf allowed; not a bool, not NaN)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    if not ok:  # NaN fails ``>= 0``
        raise InvalidArgumentError(f"{name}={value!r} is invalid; give a number of seconds >= 0")
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


INDEX_FORMS = "a 1-D integer tensor, a 1-D numpy integer array or a sequence of ints"
_INT64 = (-(2**63), 2**63)


def as_index_tensor(name: str, value: object, device: torch.device) -> torch.Tensor:
    """``value`` as a 1-D integer tensor. A tensor is checked as it is (``check_index_tensor``,
    on any device: whoever indexes with it checks where it lives); a 1-D numpy integer array or
    a sequence of ints (Python, numpy or torch integer scalars; never bools) becomes an int64
    tensor on ``device``. Anything else raises InvalidArgumentError naming the value."""
    if isinstance(value, torch.Tensor):
        return check_index_tensor(name, value, None)
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise InvalidArgumentError(
                f"{name} is a numpy array of shape {value.shape} and dtype {value.dtype}; "
                f"expected {INDEX_FORMS}"
            )
        value = value.tolist()  # exact for every integer dtype (uint64 past int64 included)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise InvalidArgumentError(f"{name}={value!r:.80} is invalid; expected {INDEX_FORMS}")
    ids = []
    for i, v in enumerate(value):
        try:
            if isinstance(v, (bool, np.bool_)):
                raise TypeError("a bool")
            ids.append(operator.index(v))
        except TypeError:
            raise InvalidArgumentError(
                f"{name}[{i}]={v!r:.40} is not an int; {name} must be {INDEX_FORMS}"
            ) from None
    bad = [v for v in ids if not _INT64[0] <= v < _INT64[1]]
    if bad:
        raise InvalidArgumentError(f"{name} has values {bad[:8]} outside the int64 range")
    return torch.tensor(ids, dtype=torch.int64, device=device)


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
