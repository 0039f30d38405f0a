"""The field checks every config section uses: each failure is an ``InvalidArgumentError``
naming ``TieredKVConfig.<field>=<value>`` and what would be valid."""

from __future__ import annotations

import math

from tiered_kv.errors import InvalidArgumentError


def _need(ok: bool, obj: object, name: str, valid: str) -> None:
    if not ok:
        raise InvalidArgumentError(
            f"TieredKVConfig.{name}={getattr(obj, name)!r} is invalid: {valid}"
        )


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ints(obj: object, names: tuple[str, ...], minimum: int = 1) -> None:
    for n in names:
        v = getattr(obj, n)
        _need(_is_int(v) and v >= minimum, obj, n, f"an int >= {minimum}")


def _choice(obj: object, name: str, options: tuple[str, ...]) -> None:
    v = getattr(obj, name)
    _need(isinstance(v, str) and v in options, obj, name, f"use one of {', '.join(options)}")


def _seconds(obj: object, name: str) -> None:
    v = getattr(obj, name)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v) and v >= 0
    _need(ok, obj, name, "a number of seconds >= 0")


def _finite(obj: object, name: str, *, positive: bool, unit: str) -> None:
    v = getattr(obj, name)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v > 0 if positive else v >= 0)
    _need(ok, obj, name, f"a finite number {'> 0' if positive else '>= 0'} ({unit})")
