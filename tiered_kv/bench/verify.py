"""What every benchmark checks of the bytes it moved, and how a failed check is reported.

A benchmark that moves wrong bytes fast has measured nothing: each one checks its results
outside the timing and stops at the first mismatch with ``fail``: a ``TieredKVError`` whose
message starts with ``CORRECTNESS FAILURE [where]``. The scripts turn that error into their exit
message with ``exit_on_failure``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, NoReturn

from tiered_kv.errors import StateError, TieredKVError

if TYPE_CHECKING:
    import torch

CHECK_FAILED = "CORRECTNESS FAILURE"


def fail(where: str, what: str, error: type[TieredKVError] = StateError) -> NoReturn:
    """Raise the check failure of ``where``: by default a StateError (the state measured is not
    the state the benchmark wrote); the transfer checks pass ``TransferError``."""
    raise error(f"{CHECK_FAILED} [{where}]: {what}")


@contextlib.contextmanager
def exit_on_failure() -> Iterator[None]:
    """Inside, a failed check exits the script with its message (``SystemExit``)."""
    try:
        yield
    except TieredKVError as exc:
        if not str(exc).startswith(CHECK_FAILED):
            raise
        raise SystemExit(str(exc)) from exc


def int_view(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers of the element's width (bit-exact comparisons, NaN included)."""
    import torch

    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(width[t.element_size()])


def sentinel_for(dtype: torch.dtype) -> int:
    """All bits set, as the integer view of ``dtype`` holds it; ``random_`` (non-negative
    integers) never produces it for dtypes wider than a byte."""
    import torch

    return 255 if torch.empty((), dtype=dtype).element_size() == 1 else -1


def first_bad_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Indices (along dim 0) of the rows where ``a`` and ``b`` differ."""
    import torch

    return torch.nonzero((a != b).reshape(a.shape[0], -1).any(dim=1))[:, 0]


def fill_random(buffers: object, seed: int, device: object) -> None:
    """Random integers in every buffer (each different), bit patterns of NaN and inf included:
    a lost or misplaced row cannot go unnoticed."""
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for buf in buffers:
        int_view(buf).random_(generator=gen)
