"""Alibaba's Qwen/Bailian usage traces (``qwen_trace*_blksz_16.jsonl``): reader, writer, and a
seeded generator of Bailian-style records.

One JSONL line is one request: ``chat_id``, ``parent_chat_id`` (-1 for a conversation's first
turn, else the previous turn's ``chat_id``), ``timestamp`` (seconds), ``input_length`` and
``output_length`` (tokens), ``type`` (one of :data:`TYPES`), ``turn`` (1 first) and ``hash_ids``
(one id per 16-token block of the prompt; a later turn's ids start with its parent's). The
simulator replays :class:`~tiered_kv.sim.traces.TraceRequest`; :func:`to_requests` turns records
into those, with timestamps kept in seconds.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.sim.traces import TraceRequest, jsonl_lines

TYPES = ("text", "image", "search", "file")
FIELDS = (
    "chat_id",
    "parent_chat_id",
    "timestamp",
    "input_length",
    "output_length",
    "type",
    "turn",
    "hash_ids",
)


@dataclass(frozen=True)
class BailianRecord:
    chat_id: int
    parent_chat_id: int  # -1: the conversation's first turn
    timestamp: float  # seconds
    input_length: int
    output_length: int
    type: str
    turn: int
    hash_ids: tuple[int, ...]


def to_requests(records: list[BailianRecord]) -> list[TraceRequest]:
    """The simulator's view of ``records``, ordered by timestamp (stable: ties keep their order)."""
    ordered = sorted(records, key=lambda r: r.timestamp)
    return [TraceRequest(r.hash_ids, r.timestamp, r.output_length, r.input_length) for r in ordered]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _record(row, where: str, seen: dict[int, int]) -> BailianRecord:
    """One validated line; ``seen`` maps earlier chat ids to their line (read, not written)."""
    if not isinstance(row, dict):
        raise InvalidArgumentError(f"{where}: a JSON object with {', '.join(FIELDS)} expected")
    missing = [k for k in FIELDS if k not in row]
    if missing:
        raise InvalidArgumentError(f"{where}: missing {', '.join(missing)}")
    for name, low in (("chat_id", 0), ("input_length", 0), ("output_length", 0), ("turn", 1)):
        if not _is_int(row[name]) or row[name] < low:
            raise InvalidArgumentError(f"{where}: {name}={row[name]!r} must be an int >= {low}")
    chat, parent = row["chat_id"], row["parent_chat_id"]
    if chat in seen:
        raise InvalidArgumentError(f"{where}: chat_id={chat} is already line {seen[chat]}'s")
    # A parent that names no earlier line is fine (a trace cut from a longer one).
    if not _is_int(parent) or parent < -1 or parent == chat:
        raise InvalidArgumentError(
            f"{where}: parent_chat_id={parent!r} must be -1 (a first turn) or another request's "
            f"chat_id (an int >= 0)"
        )
    ts = row["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise InvalidArgumentError(f"{where}: timestamp={ts!r} must be a finite number (seconds)")
    if row["type"] not in TYPES:
        raise InvalidArgumentError(f"{where}: type={row['type']!r} must be one of {TYPES}")
    ids = row["hash_ids"]
    if not isinstance(ids, list) or not all(_is_int(i) for i in ids):
        raise InvalidArgumentError(f"{where}: hash_ids={ids!r:.60} must be a list of ints")
    return BailianRecord(
        chat,
        parent,
        float(ts),
        row["input_length"],
        row["output_length"],
        row["type"],
        row["turn"],
        tuple(ids),
    )


def read_bailian(path: str | Path) -> list[BailianRecord]:
    """Every record of a Bailian JSONL file, in file order (blank lines skipped). Raises
    :class:`InvalidArgumentError` naming the file, the line and the bad field (or the byte, for
    a line that is not UTF-8); returns nothing on a failure, and fails on a file with no
    requests."""
    out: list[BailianRecord] = []
    seen: dict[int, int] = {}
    for n, line in jsonl_lines(path):
        where = f"{path}:{n}: not a Bailian trace line"
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise InvalidArgumentError(f"{where} ({exc})") from None
        out.append(_record(row, where, seen))
        seen[out[-1].chat_id] = n
    if not out:
        raise InvalidArgumentError(f"{path}: no requests")
    return out


def load_bailian(path: str | Path) -> list[TraceRequest]:
    """A Bailian JSONL file as the simulator's trace: :func:`read_bailian` then
    :func:`to_requests` (sorted by timestamp, stable)."""
    return to_requests(read_bailian(path))


def write_bailian(records: list[BailianRecord], path: str | Path) -> None:
    """Write ``records`` as Bailian JSONL, in the given order (:func:`read_bailian` reads them
    back equal; timestamps are written as floats, exactly)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            row = {k: getattr(r, k) for k in FIELDS}
            row["hash_ids"] = list(r.hash_ids)
            f.write(json.dumps(row) + "\n")


def is_bailian(path: str | Path) -> bool:
    """Whether the first non-empty line of ``path`` is a JSON object with a ``chat_id`` (a
    Bailian trace; otherwise the file is taken for Mooncake's). A first line that is not UTF-8
    raises :class:`InvalidArgumentError`, as :func:`read_bailian` does."""
    for _, line in jsonl_lines(path):
        try:
            row = json.loads(line)
        except ValueError:
            return False
        return isinstance(row, dict) and "chat_id" in row
    return False


# Per type: (system prompt blocks, first turn's new tokens, a later turn's new tokens), the
# token counts lognormal as (median, sigma). Search turns carry retrieved pages, a file's first
# turn the document; an image turn adds one image of a few fixed block runs (IMAGE_BLOCKS).
_SHAPES = {
    "text": ((4, 40), (200, 1.0), (80, 1.0)),
    "image": ((4, 16), (40, 0.8), (30, 0.8)),
    "search": ((20, 80), (2500, 0.5), (2000, 0.5)),
    "file": ((10, 40), (6000, 0.8), (100, 1.0)),
}
IMAGE_BLOCKS = (64, 80, 144, 256)  # 1024 .. 4096 tokens: a few resolutions


def bailian(
    *,
    requests: int = 4000,
    type_weights: tuple[float, float, float, float] = (0.6, 0.15, 0.15, 0.1),
    system_prompts: int = 3,
    mean_turns: float = 2.5,
    mean_gap_s: float = 0.5,
    mean_think_s: float = 45.0,
    decode_s: float = 0.02,
    max_prompt_tokens: int = 32768,
    block_size: int = 16,
    seed: int = 0,
) -> list[BailianRecord]:
    """Bailian-style records, ordered by timestamp (``chat_id`` = position), deterministic for
    ``seed``. Conversations arrive at exponential gaps (``mean_gap_s``), each of one type drawn
    with ``type_weights`` (in :data:`TYPES` order) and opening with one of that type's
    ``system_prompts`` shared prompts (the first most used). A turn's ``hash_ids`` are its
    parent's, the parent's answer (``output_length`` rounded up to blocks) and the new user
    blocks; every block id outside the system prompts belongs to one conversation. The next turn
    comes ``output_length * decode_s`` plus an exponential think time (``mean_think_s``) later;
    turns per conversation are geometric with mean ``mean_turns``, and a conversation ends
    early when its next prompt would pass ``max_prompt_tokens`` (a first turn is cut to fit).
    ``input_length`` is in ``((n - 1) * block_size, n * block_size]`` for ``n`` blocks. Use
    :func:`to_requests` for the simulator, :func:`write_bailian` for a file."""
    for name, v in (
        ("requests", requests),
        ("system_prompts", system_prompts),
        ("block_size", block_size),
        ("max_prompt_tokens", max_prompt_tokens),
    ):
        if not _is_int(v) or v < 1:
            raise InvalidArgumentError(f"{name}={v!r} must be an int >= 1")
    if len(type_weights) != len(TYPES) or min(type_weights) < 0 or sum(type_weights) <= 0:
        raise InvalidArgumentError(
            f"type_weights={type_weights!r} must be {len(TYPES)} weights >= 0 (for {TYPES}) "
            f"with a positive sum"
        )
    if mean_turns < 1 or mean_gap_s <= 0 or mean_think_s < 0 or decode_s < 0:
        raise InvalidArgumentError(
            f"mean_turns={mean_turns}, mean_gap_s={mean_gap_s}, mean_think_s={mean_think_s}, "
            f"decode_s={decode_s}: need mean_turns >= 1, mean_gap_s > 0, the others >= 0"
        )
    max_blocks = max_prompt_tokens // block_size
    longest = max(_SHAPES[t][0][1] for t in TYPES) + 1
    if max_blocks < longest:
        raise InvalidArgumentError(
            f"max_prompt_tokens={max_prompt_tokens} holds {max_blocks} blocks of {block_size}; "
            f"the longest system prompt and a turn need {longest}: use >= {longest * block_size}"
        )
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    def tokens(median: float, sigma: float) -> int:
        return max(1, round(rng.lognormvariate(math.log(median), sigma)))

    system = {t: [fresh(rng.randint(*_SHAPES[t][0])) for _ in range(system_prompts)] for t in TYPES}
    # (timestamp, creation order, parent's creation order or -1, type, turn, ids, output)
    pending: list[tuple[float, int, int, str, int, list[int], int]] = []
    t = 0.0
    while len(pending) < requests:
        t += rng.expovariate(1.0 / mean_gap_s)
        kind = rng.choices(TYPES, weights=type_weights)[0]
        history = system[kind][min(int(rng.paretovariate(1.2)) - 1, system_prompts - 1)]
        at, parent, turn = t, -1, 1
        while len(pending) < requests:
            new = -(-tokens(*_SHAPES[kind][1 if turn == 1 else 2]) // block_size)
            if kind == "image":
                new += rng.choice(IMAGE_BLOCKS)
            if len(history) + new > max_blocks:
                if turn > 1:
                    break
                new = max_blocks - len(history)
            ids = history + fresh(new)
            output = min(4096, tokens(180, 0.9))
            pending.append((round(at, 3), len(pending), parent, kind, turn, ids, output))
            if rng.random() < 1.0 / mean_turns:
                break
            parent, turn = len(pending) - 1, turn + 1
            history = ids + fresh(-(-output // block_size))
            think = rng.expovariate(1.0 / mean_think_s) if mean_think_s else 0.0
            at += output * decode_s + think
    pending.sort(key=lambda p: (p[0], p[1]))
    chat_of = {p[1]: i for i, p in enumerate(pending)}
    return [
        BailianRecord(
            i,
            chat_of[parent] if parent >= 0 else -1,
            at,
            (len(ids) - 1) * block_size + rng.randint(1, block_size),
            output,
            kind,
            turn,
            tuple(ids),
        )
        for i, (at, _, parent, kind, turn, ids, output) in enumerate(pending)
    ]
