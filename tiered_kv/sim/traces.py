"""Request traces for hit-rate experiments: Mooncake JSONL and two generators.

A trace is a list of :class:`TraceRequest`, each a sequence of block ids (one id per KV block of
``block_size`` tokens). Ids are prefix-dependent, as in Mooncake's ``hash_ids``: two requests
share a block id only if they share the whole prefix up to and including that block.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tiered_kv.errors import InvalidArgumentError

REPEAT_MODES = ("random", "tile", "interleave")
GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True)
class TraceRequest:
    blocks: tuple[int, ...]
    timestamp: float = 0.0
    output_length: int = 0
    input_length: int = 0  # prompt tokens (generators: the block-rounded prompt)


def unique_blocks(trace: list[TraceRequest]) -> int:
    return len({b for r in trace for b in r.blocks})


def not_utf8(data: bytes, at: int, offset: int = 0) -> str:
    """Why a trace file is not text: byte ``at`` of ``data`` (its bytes from ``offset``) is not
    UTF-8. Names that byte and its offset in the file (or says the file is gzip-compressed), and
    the fix."""
    if offset == 0 and data.startswith(GZIP_MAGIC):
        return "not UTF-8 text but gzip-compressed; decompress it first (gunzip)"
    return f"not UTF-8 text (byte {data[at]:#04x} at offset {offset + at}); a trace is JSONL text"


def jsonl_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """The non-blank lines of a JSONL file with their numbers (from 1), decoded as UTF-8 (JSON's
    encoding, whatever the locale's). Raises :class:`InvalidArgumentError` naming the file and
    the line at the first that is not UTF-8 (a binary or compressed file); an ``OSError``
    (no such file) passes through."""
    offset = 0
    with open(path, "rb") as f:
        # Lines split on b"\n", which is never part of a longer UTF-8 character.
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidArgumentError(
                    f"{path}:{n}: {not_utf8(raw, exc.start, offset)}"
                ) from None
            offset += len(raw)
            if line.strip():
                yield n, line


def load_mooncake(path: str | Path) -> list[TraceRequest]:
    """Mooncake JSONL: one object per line with ``timestamp``, ``input_length``,
    ``output_length`` and ``hash_ids``. Raises :class:`InvalidArgumentError` naming the line
    for a malformed one (or one that is not UTF-8)."""
    out = []
    for n, line in jsonl_lines(path):
        try:
            row = json.loads(line)
            ids = row["hash_ids"]
            if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids
            ):
                raise InvalidArgumentError(
                    f"{path}:{n}: not a Mooncake trace line (hash_ids must be ints)"
                )
            out.append(
                TraceRequest(
                    tuple(ids),
                    float(row.get("timestamp", 0)),
                    int(row.get("output_length", 0)),
                    int(row.get("input_length", 0)),
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgumentError(f"{path}:{n}: not a Mooncake trace line ({exc})") from None
    if not out:
        raise InvalidArgumentError(f"{path}: no requests")
    return out


class _Chain:
    """Prefix-dependent block ids from content ids (a hash chain, like Mooncake's)."""

    def __init__(self) -> None:
        self._ids: dict[bytes, int] = {}

    def ids(self, contents: list[tuple]) -> tuple[int, ...]:
        prior = b""
        out = []
        for c in contents:
            prior = hashlib.blake2b(prior + repr(c).encode(), digest_size=16).digest()
            out.append(self._ids.setdefault(prior, len(self._ids)))
        return tuple(out)


def _blocks(tokens: int, block_size: int) -> int:
    return max(1, -(-tokens // block_size))


def multi_round_qa(
    *,
    users: int,
    rounds: int,
    shared_prompt: int,
    history: int,
    answer: int,
    num_shared_prompts: int = 1,
    block_size: int = 16,
    seed: int = 0,
) -> list[TraceRequest]:
    """Users chatting in rounds: each prompt is a shared system prompt, the user's history
    (earlier questions and answers, the last ``history`` tokens' worth is kept growing) and a new
    question of ``answer`` tokens; the answer joins the history. Users take turns in a random
    order each round. Sizes in tokens."""
    for name, v in (
        ("users", users),
        ("rounds", rounds),
        ("shared_prompt", shared_prompt),
        ("history", history),
        ("answer", answer),
        ("block_size", block_size),
        ("num_shared_prompts", num_shared_prompts),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "history" else 1):
            low = 0 if name == "history" else 1
            raise InvalidArgumentError(f"{name}={v!r} must be an int >= {low}")
    rng = random.Random(seed)
    chain = _Chain()
    system = [
        [("sys", s, i) for i in range(_blocks(shared_prompt, block_size))]
        for s in range(num_shared_prompts)
    ]
    hist: dict[int, list[tuple]] = {
        u: [("hist", u, i) for i in range(history // block_size)] for u in range(users)
    }
    out = []
    t = 0.0
    for r in range(rounds):
        order = list(range(users))
        rng.shuffle(order)
        for u in order:
            turn = [("q", u, r, i) for i in range(_blocks(answer, block_size))]
            contents = system[u % num_shared_prompts] + hist[u] + turn
            out.append(TraceRequest(chain.ids(contents), t, answer, len(contents) * block_size))
            hist[u] = hist[u] + turn + [("a", u, r, i) for i in range(_blocks(answer, block_size))]
            t += 1.0
    return out


def long_doc_qa(
    *,
    documents: int,
    document_length: int,
    questions: int = 2,
    repeat: str = "random",
    question_length: int = 32,
    block_size: int = 16,
    seed: int = 0,
) -> list[TraceRequest]:
    """Questions over long documents: each request is one document followed by a question.
    ``repeat``: ``random`` (questions in random order), ``tile`` (every document once, then
    all again: d0 d1 .. d0 d1 ..), ``interleave`` (each document's questions back to back)."""
    if repeat not in REPEAT_MODES:
        raise InvalidArgumentError(
            f"repeat={repeat!r} is unknown; use one of {', '.join(REPEAT_MODES)}"
        )
    for name, v in (
        ("documents", documents),
        ("document_length", document_length),
        ("questions", questions),
        ("question_length", question_length),
        ("block_size", block_size),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InvalidArgumentError(f"{name}={v!r} must be an int >= 1")
    rng = random.Random(seed)
    chain = _Chain()
    pairs = [(d, q) for q in range(questions) for d in range(documents)]  # tile order
    if repeat == "interleave":
        pairs.sort()
    elif repeat == "random":
        rng.shuffle(pairs)
    out = []
    for t, (d, q) in enumerate(pairs):
        doc = [("doc", d, i) for i in range(_blocks(document_length, block_size))]
        ask = [("ask", d, q, i) for i in range(_blocks(question_length, block_size))]
        blocks = chain.ids(doc + ask)
        out.append(TraceRequest(blocks, float(t), question_length, len(blocks) * block_size))
    return out


def conversation(
    *,
    requests: int = 12031,
    system_prompts: int = 8,
    system_blocks: tuple[int, int] = (2, 12),
    first_turn_blocks: tuple[int, int] = (2, 24),
    turn_blocks: tuple[int, int] = (1, 4),
    mean_turns: float = 3.0,
    mean_gap_ms: float = 300.0,
    mean_think_ms: float = 60_000.0,
    block_size: int = 512,
    seed: int = 0,
) -> list[TraceRequest]:
    """A Mooncake-style conversation trace: sessions arrive at exponential gaps
    (``mean_gap_ms``), each opens with one of ``system_prompts`` shared system prompts and a
    first user turn, and every later turn resends the whole conversation so far (its ids extend
    the previous turn's) plus the answer and a new question, after an exponential think time.
    Turns per session are geometric with mean ``mean_turns``. Requests are ordered by
    timestamp (ms, as in Mooncake's traces); ranges are inclusive block counts."""
    for name, v in (("requests", requests), ("system_prompts", system_prompts)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InvalidArgumentError(f"{name}={v!r} must be an int >= 1")
    for name, (lo, hi) in (
        ("system_blocks", system_blocks),
        ("first_turn_blocks", first_turn_blocks),
        ("turn_blocks", turn_blocks),
    ):
        if not 1 <= lo <= hi:
            raise InvalidArgumentError(f"{name}=({lo}, {hi}) must satisfy 1 <= low <= high")
    if mean_turns < 1:
        raise InvalidArgumentError(f"mean_turns={mean_turns} must be >= 1")
    rng = random.Random(seed)
    chain = _Chain()
    system = [
        [("sys", s, i) for i in range(rng.randint(*system_blocks))] for s in range(system_prompts)
    ]
    pending: list[tuple[float, int, tuple[int, ...], int]] = []
    t, session = 0.0, 0
    while len(pending) < requests:
        t += rng.expovariate(1.0 / mean_gap_ms)
        contents = list(system[min(int(rng.paretovariate(1.2)) - 1, system_prompts - 1)])
        contents += [("u", session, 0, i) for i in range(rng.randint(*first_turn_blocks))]
        at, turn = t, 0
        while len(pending) < requests:
            output = rng.randint(16, 700)
            pending.append((at, len(pending), chain.ids(contents), output))
            if rng.random() < 1.0 / mean_turns:
                break
            turn += 1
            at += rng.expovariate(1.0 / mean_think_ms)
            # The answer (output tokens, rounded up to blocks) then the next question.
            contents += [("a", session, turn, i) for i in range(_blocks(output, block_size))]
            contents += [("u", session, turn, i) for i in range(rng.randint(*turn_blocks))]
        session += 1
    pending.sort()
    return [
        TraceRequest(ids, round(at), output, len(ids) * block_size - rng.randrange(block_size))
        for at, _, ids, output in pending
    ]


def write_mooncake(trace: list[TraceRequest], path: str | Path) -> None:
    """Write ``trace`` as Mooncake JSONL (``load_mooncake`` reads it back)."""
    with open(path, "w") as f:
        for r in trace:
            row = {
                "timestamp": int(r.timestamp),
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.blocks),
            }
            f.write(json.dumps(row) + "\n")
