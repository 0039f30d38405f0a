"""Bytes, seconds and operations moved per direction between the tiers (thread-safe)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import Direction

DIRECTIONS = Direction.values()


@dataclass
class DirectionStats:
    bytes: int = 0
    seconds: float = 0.0
    ops: int = 0
    failed_ops: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class TransferStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by = {Direction(d): DirectionStats() for d in DIRECTIONS}

    def add(self, direction: str, nbytes: int, seconds: float, ok: bool = True) -> None:
        if direction not in self._by:
            raise InvalidArgumentError(
                f"direction={direction!r} is not a transfer direction; use one of {DIRECTIONS}"
            )
        with self._lock:
            s = self._by[direction]
            s.ops += 1
            if ok:
                s.bytes += nbytes
                s.seconds += seconds
            else:
                s.failed_ops += 1

    def snapshot(self) -> dict[str, DirectionStats]:
        with self._lock:
            return {
                d.value: DirectionStats(s.bytes, s.seconds, s.ops, s.failed_ops)
                for d, s in self._by.items()
            }
