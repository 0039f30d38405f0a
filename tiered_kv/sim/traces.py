"""Request traces for hit-rate experiments: Mooncake JSONL and two generators.

A trace is a list of :class:`TraceRequest`, each a sequence of block ids (one id per KV block of
``block_size`` tokens). Ids are prefix-dependent, as in Mooncake's ``hash_ids``: two requests
share a block id only if they share the whole prefix up to and including that block.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from tiered_kv.errors import InvalidArgumentError

REPEAT_MODES = ("random", "tile", "interleave")


@dataclass(frozen=True)
class TraceRequest:
    blocks: tuple[int, ...]
    timestamp: float = 0.0
    output_length: int = 0
    input_length: int = 0  # prompt tokens (generators: the block-rounded prompt)


def unique_blocks(trace: list[TraceRequest]) -> int:
    return len({b for r in trace for b in r.blocks})


def load_mooncake(path: str | Path) -> list[TraceRequest]:
    """Mooncake JSONL: one object per line with ``timestamp``, ``input_length``,
    ``output_length`` and ``hash_ids``. Raises naming the line for a malformed one."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
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
                raise InvalidArgumentError(
                    f"{path}:{n}: not a Mooncake trace line ({exc})"
                ) from None
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
