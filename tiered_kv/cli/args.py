"""Argument types for the command line: each rejects a bad value with a message naming it."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from tiered_kv.storage_config import BACKEND_HINT, StorageConfig, backend_ok


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        return value

    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


def float_in(low: float, high: float = math.inf, *, low_in: bool = False, high_in: bool = True):
    """A finite number from ``low`` to ``high`` (each end included where ``low_in`` /
    ``high_in``; ``high`` inf: no upper end). ``inf``, ``nan`` and what reads as inf (``1e400``)
    are refused here, when the arguments are parsed, so the message names the flag rather than
    the field of a config built later (and before torch is imported)."""
    if high == math.inf:
        valid = f"{'>=' if low_in else '>'} {low:g}"
    else:
        valid = f"in {'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number; give one {valid}")
        if not (low <= value if low_in else low < value) or not (
            value <= high if high_in else value < high
        ):
            raise argparse.ArgumentTypeError(f"{value} must be {valid}")
        return value

    return parse


positive_float = float_in(0)
non_negative_float = float_in(0, low_in=True)


def fraction(text: str) -> float:
    """A number in [0, 1] (NaN refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} must be a fraction from 0 to 1")
    return value


def capacity_list(text: str) -> list[float]:
    """Comma-separated capacities: fractions of the unique blocks (0 < f <= 1, e.g. 0.05) or
    absolute block counts (integers > 1)."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not a number") from None
        if not math.isfinite(value) or value <= 0 or (value > 1 and value != int(value)):
            raise argparse.ArgumentTypeError(
                f"{part!r}: give a fraction of the unique blocks in (0, 1] or a whole block count"
            )
        out.append(value)
    if not out:
        raise argparse.ArgumentTypeError("no capacities given")
    return out


def name_list(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        names = [p.strip() for p in str(text).split(",") if p.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"{', '.join(bad) or 'nothing'}: use one or more of {', '.join(choices)}"
            )
        return names

    return parse


def default_cache_dir() -> Path:
    from tiered_kv import platform  # imports torch: not while the parser is built

    return platform.cache_dir()


def json_object(text: str) -> dict:
    """A flag's value as one JSON object (a backend's options)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def add_storage_backend_arguments(group) -> None:
    """``--storage-backend``, ``--storage-options``, ``--storage-local-copy`` and
    ``--storage-optional`` on ``group``."""
    group.add_argument(
        "--storage-backend",
        default=StorageConfig.storage_backend,
        help=f"the storage tier: {BACKEND_HINT}",
    )
    group.add_argument(
        "--storage-options",
        type=json_object,
        default=None,
        help='the backend\'s own options as one JSON object, e.g. {"url": "redis://host:6379/0"}',
    )
    group.add_argument(
        "--storage-local-copy",
        action="store_true",
        help="keep a local store in front of a remote backend (a node's hot pages survive "
        "restarts and outages of the shared store)",
    )
    group.add_argument(
        "--storage-optional",
        action="store_true",
        help="a remote backend that cannot be reached at the start is not an error: serve "
        "without it (every lookup a miss until it answers; the summary says so)",
    )


def check_storage_backend(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse a malformed ``--storage-backend`` (an unimportable or unreachable one is refused
    when the command starts, before any work: ``store_status.check_remote_store``)."""
    if not backend_ok(args.storage_backend):
        parser.error(f"--storage-backend {args.storage_backend!r}: use {BACKEND_HINT}")
