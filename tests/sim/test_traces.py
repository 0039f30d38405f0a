"""Traces: the Mooncake JSONL loader and the two generators (multi-round QA, long-doc QA)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.sim.traces import (
    REPEAT_MODES,
    TraceRequest,
    _Chain,
    load_mooncake,
    long_doc_qa,
    multi_round_qa,
    unique_blocks,
)

# Four lines of the Mooncake-format example trace (lines 6, 12, 16 and 59): the last shares its
# first five blocks with the third.
MOONCAKE_LINES = [
    '{"timestamp": 529, "input_length": 28, "output_length": 445, "hash_ids": [298]}',
    '{"timestamp": 2775, "input_length": 546, "output_length": 78, "hash_ids": [499, 500]}',
    '{"timestamp": 3437, "input_length": 2752, "output_length": 35, '
    '"hash_ids": [708, 709, 710, 711, 712, 713]}',
    '{"timestamp": 16801, "input_length": 2754, "output_length": 50, '
    '"hash_ids": [708, 709, 710, 711, 712, 1469]}',
]

MRQ = dict(users=5, rounds=4, shared_prompt=48, history=32, answer=20, num_shared_prompts=2)


def _write(tmp_path, lines, name="trace.jsonl"):
    p = tmp_path / name
    p.write_text("".join(line + "\n" for line in lines))
    return p


# -- Mooncake loader ------------------------------------------------------------------------------
def test_load_mooncake_reads_every_field(tmp_path):
    trace = load_mooncake(_write(tmp_path, MOONCAKE_LINES))
    assert trace == [
        TraceRequest((298,), 529.0, 445, 28),
        TraceRequest((499, 500), 2775.0, 78, 546),
        TraceRequest((708, 709, 710, 711, 712, 713), 3437.0, 35, 2752),
        TraceRequest((708, 709, 710, 711, 712, 1469), 16801.0, 50, 2754),
    ]
    assert [r.input_length for r in trace] == [28, 546, 2752, 2754]
    assert [r.output_length for r in trace] == [445, 78, 35, 50]
    assert [r.timestamp for r in trace] == [529, 2775, 3437, 16801]
    assert unique_blocks(trace) == 1 + 2 + 6 + 1


def test_load_mooncake_skips_blank_lines_and_defaults_optional_fields(tmp_path):
    p = _write(tmp_path, ["", MOONCAKE_LINES[0], "   ", '{"hash_ids": [1, 2]}', ""])
    trace = load_mooncake(str(p))  # a str path works too
    assert trace == [TraceRequest((298,), 529.0, 445, 28), TraceRequest((1, 2), 0.0, 0, 0)]


@pytest.mark.parametrize(
    "bad",
    [
        '{"timestamp": 1, "hash_ids": [1, 2',  # bad JSON
        '{"timestamp": 1, "input_length": 3, "output_length": 2}',  # no hash_ids
        '{"hash_ids": [1, "2"]}',  # a non-int id
        '{"hash_ids": [1, 2.0]}',
        '{"hash_ids": [1, true]}',
        '{"hash_ids": null}',
        '{"hash_ids": "1 2"}',
        "[1, 2, 3]",  # not an object
        '"hash_ids"',
        '{"hash_ids": [1], "output_length": "many"}',
        '{"hash_ids": [1], "timestamp": "noon"}',
    ],
)
def test_load_mooncake_malformed_line_names_file_and_line(tmp_path, bad):
    p = _write(tmp_path, [MOONCAKE_LINES[0], "", MOONCAKE_LINES[1], bad, MOONCAKE_LINES[2]])
    with pytest.raises(InvalidArgumentError) as exc:
        load_mooncake(p)
    assert f"{p}:4:" in str(exc.value)


@pytest.mark.parametrize("lines", [[], [""], ["   ", "", "\t"]])
def test_load_mooncake_without_requests_raises(tmp_path, lines):
    p = _write(tmp_path, lines, "empty.jsonl")
    with pytest.raises(InvalidArgumentError, match="no requests") as exc:
        load_mooncake(p)
    assert str(p) in str(exc.value)


# -- generator helpers ----------------------------------------------------------------------------
def _prefix_dependent(trace, contents):
    """Brute force: block i of two requests has the same id iff their contents agree on
    blocks 0..i (``contents[k]`` is request k's list of content items)."""
    for a in range(len(trace)):
        for b in range(a, len(trace)):
            ba, bb = trace[a].blocks, trace[b].blocks
            for i in range(min(len(ba), len(bb))):
                same_prefix = contents[a][: i + 1] == contents[b][: i + 1]
                assert (ba[i] == bb[i]) == same_prefix, (a, b, i)
            if a == b:
                assert len(set(ba)) == len(ba)  # no block repeats within one request


def _mrq_contents(users, rounds, shared_prompt, history, answer, num_shared_prompts, block_size):
    """Independent model of a multi-round conversation: {(user, round): prompt content}."""

    def nblocks(tokens):
        return max(1, -(-tokens // block_size))

    hist = {u: [("hist", u, i) for i in range(history // block_size)] for u in range(users)}
    system = [
        [("sys", s, i) for i in range(nblocks(shared_prompt))] for s in range(num_shared_prompts)
    ]
    out = {}
    for r in range(rounds):
        for u in range(users):
            turn = [("q", u, r, i) for i in range(nblocks(answer))]
            out[u, r] = system[u % num_shared_prompts] + hist[u] + turn
            hist[u] = hist[u] + turn + [("a", u, r, i) for i in range(nblocks(answer))]
    return out


def _recover_users(trace, users, rounds, nsys, num_shared_prompts):
    """(model user, round) of each request, from the trace alone: requests come in rounds of
    ``users``; a round-0 prompt's shared-prompt blocks give its group (users ``u`` with the same
    ``u % num_shared_prompts``; which user within a group is not observable, so members are
    matched in order); a later prompt belongs to the one prompt of the previous round that it
    extends. Asserts the structure on the way."""
    assert len(trace) == users * rounds
    model_groups: dict[int, list[int]] = {}
    for u in range(users):
        model_groups.setdefault(u % num_shared_prompts, []).append(u)
    trace_groups: dict[tuple, list[int]] = {}
    for k in range(users):
        trace_groups.setdefault(trace[k].blocks[:nsys], []).append(k)
    assert len(trace_groups) == min(users, num_shared_prompts)
    assert sorted(map(len, trace_groups.values())) == sorted(map(len, model_groups.values()))
    owner: dict[int, int] = {}
    free = dict(model_groups)
    for members in trace_groups.values():
        g = next(g for g, us in free.items() if len(us) == len(members))
        owner.update(zip(members, free.pop(g), strict=True))
    for k in range(users, len(trace)):
        rnd = k // users
        prev = [
            j
            for j in range((rnd - 1) * users, rnd * users)
            if trace[k].blocks[: len(trace[j].blocks)] == trace[j].blocks
        ]
        assert len(prev) == 1, (k, prev)  # extends exactly one prompt of the previous round
        assert len(trace[k].blocks) > len(trace[prev[0]].blocks)  # the history grew
        owner[k] = owner[prev[0]]
    for rnd in range(rounds):  # every user speaks once per round
        assert sorted(owner[k] for k in range(rnd * users, (rnd + 1) * users)) == list(range(users))
    return [(owner[k], k // users) for k in range(len(trace))]


# -- multi-round QA -------------------------------------------------------------------------------
def test_multi_round_is_deterministic_per_seed():
    a = multi_round_qa(**MRQ, block_size=16, seed=3)
    b = multi_round_qa(**MRQ, block_size=16, seed=3)
    c = multi_round_qa(**MRQ, block_size=16, seed=4)
    assert a == b
    assert [r.blocks for r in a] != [r.blocks for r in c]  # the user order is seeded
    assert Counter(len(r.blocks) for r in a) == Counter(len(r.blocks) for r in c)


@pytest.mark.parametrize("seed", [0, 1, 7])
@pytest.mark.parametrize(
    "params",
    [
        dict(MRQ, block_size=16),
        dict(MRQ, block_size=7),
        dict(MRQ, block_size=64),  # every part fits one block
        dict(MRQ, num_shared_prompts=1, block_size=16),
        dict(MRQ, num_shared_prompts=3, history=0, block_size=16),
    ],
)
def test_multi_round_structure_and_prefix_dependent_ids(params, seed):
    trace = multi_round_qa(**params, seed=seed)
    users, rounds, bs = params["users"], params["rounds"], params["block_size"]
    nsys = max(1, -(-params["shared_prompt"] // bs))
    nq = max(1, -(-params["answer"] // bs))
    who = _recover_users(trace, users, rounds, nsys, params["num_shared_prompts"])
    model = _mrq_contents(**params)
    contents = [model[key] for key in who]
    # Two requests share block i iff their contents agree through block i.
    _prefix_dependent(trace, contents)
    assert unique_blocks(trace) == len({tuple(c[: i + 1]) for c in contents for i in range(len(c))})
    # The shared system prompt: the same blocks for users of the same prompt, none in common
    # for users of different prompts; nothing past it is shared between users.
    for k, (u, _) in enumerate(who):
        for j, (v, _) in enumerate(who):
            same = u % params["num_shared_prompts"] == v % params["num_shared_prompts"]
            assert (trace[k].blocks[:nsys] == trace[j].blocks[:nsys]) == same
            assert bool(set(trace[k].blocks[:nsys]) & set(trace[j].blocks)) == same
            if u != v:
                assert not set(trace[k].blocks[nsys:]) & set(trace[j].blocks)
    for k, req in enumerate(trace):
        rnd = k // users
        # system prompt + initial history + earlier rounds' questions and answers + this one
        assert len(req.blocks) == nsys + params["history"] // bs + (2 * rnd + 1) * nq
        assert req.output_length == params["answer"]
        assert req.input_length == len(req.blocks) * bs
        assert req.timestamp == float(k)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(users=0), "users"),
        (dict(rounds=0), "rounds"),
        (dict(shared_prompt=0), "shared_prompt"),
        (dict(history=-1), "history"),
        (dict(answer=0), "answer"),
        (dict(block_size=0), "block_size"),
        (dict(num_shared_prompts=0), "num_shared_prompts"),
        (dict(users=2.0), "users"),
        (dict(rounds=True), "rounds"),
        (dict(answer="8"), "answer"),
    ],
)
def test_multi_round_bad_arguments_name_the_argument(kwargs, name):
    args = dict(MRQ, **kwargs)
    with pytest.raises(InvalidArgumentError, match=rf"^{name}="):
        multi_round_qa(**args)


def test_multi_round_zero_history_is_allowed():
    trace = multi_round_qa(**dict(MRQ, history=0), block_size=16)
    nsys, nq = 3, 2
    assert [len(r.blocks) for r in trace[: MRQ["users"]]] == [nsys + nq] * MRQ["users"]


# -- long-document QA -----------------------------------------------------------------------------
@pytest.mark.parametrize("repeat", REPEAT_MODES)
def test_long_doc_is_deterministic_per_seed(repeat):
    kw = dict(documents=5, document_length=64, questions=3, repeat=repeat, block_size=16)
    a = long_doc_qa(**kw, seed=11)
    assert a == long_doc_qa(**kw, seed=11)
    if repeat == "random":
        assert [r.blocks for r in a] != [r.blocks for r in long_doc_qa(**kw, seed=12)]
    else:  # only the random mode uses the seed
        assert a == long_doc_qa(**kw, seed=12)


def _long_doc_contents(documents, questions, doc_blocks, ask_blocks, pairs):
    return [
        [("doc", d, i) for i in range(doc_blocks)] + [("ask", d, q, i) for i in range(ask_blocks)]
        for d, q in pairs
    ]


def _pairs(trace, doc_blocks):
    """(document, question) per request, both numbered in order of first appearance."""
    docs: list[tuple] = []
    asks: dict[tuple, list[tuple]] = {}
    out = []
    for r in trace:
        doc, ask = r.blocks[:doc_blocks], r.blocks[doc_blocks:]
        if doc not in docs:
            docs.append(doc)
        qs = asks.setdefault(doc, [])
        if ask not in qs:
            qs.append(ask)
        out.append((docs.index(doc), qs.index(ask)))
    return out


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("repeat", REPEAT_MODES)
def test_long_doc_repeat_modes(repeat, seed):
    documents, questions, block_size = 4, 3, 16
    trace = long_doc_qa(
        documents=documents,
        document_length=70,  # 5 blocks (rounded up)
        questions=questions,
        repeat=repeat,
        question_length=20,  # 2 blocks
        block_size=block_size,
        seed=seed,
    )
    doc_blocks, ask_blocks = 5, 2
    assert len(trace) == documents * questions
    assert all(len(r.blocks) == doc_blocks + ask_blocks for r in trace)
    pairs = _pairs(trace, doc_blocks)
    # Every (document, question) pair exactly once.
    assert sorted(pairs) == [(d, q) for d in range(documents) for q in range(questions)]
    docs = [d for d, _ in pairs]
    if repeat == "tile":  # d0 d1 .. d0 d1 ..
        assert docs == list(range(documents)) * questions
        assert [q for _, q in pairs] == [q for q in range(questions) for _ in range(documents)]
    elif repeat == "interleave":  # each document's questions back to back
        assert docs == [d for d in range(documents) for _ in range(questions)]
        assert [q for _, q in pairs] == list(range(questions)) * documents
    else:  # a permutation, not one of the fixed orders (for these seeds)
        assert docs != list(range(documents)) * questions
        assert docs != [d for d in range(documents) for _ in range(questions)]
    _prefix_dependent(
        trace, _long_doc_contents(documents, questions, doc_blocks, ask_blocks, pairs)
    )
    assert unique_blocks(trace) == documents * doc_blocks + documents * questions * ask_blocks
    assert [r.timestamp for r in trace] == [float(i) for i in range(len(trace))]
    assert all(r.output_length == 20 for r in trace)
    assert all(r.input_length == (doc_blocks + ask_blocks) * block_size for r in trace)


def test_long_doc_random_is_a_permutation_of_tile():
    kw = dict(documents=6, document_length=32, questions=4, block_size=16)
    rand = long_doc_qa(**kw, repeat="random", seed=9)
    tile = long_doc_qa(**kw, repeat="tile", seed=9)
    # Ids are numbered in first-seen order, so compare by content: (doc, question) pairs.
    assert sorted(_pairs(rand, 2)) == sorted(_pairs(tile, 2))
    assert _pairs(rand, 2) != _pairs(tile, 2)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(documents=0), "documents"),
        (dict(document_length=0), "document_length"),
        (dict(questions=0), "questions"),
        (dict(question_length=0), "question_length"),
        (dict(block_size=-16), "block_size"),
        (dict(documents=1.5), "documents"),
        (dict(questions=False), "questions"),
        (dict(repeat="shuffle"), "repeat"),
        (dict(repeat=None), "repeat"),
    ],
)
def test_long_doc_bad_arguments_name_the_argument(kwargs, name):
    args = {"documents": 2, "document_length": 32, **kwargs}
    with pytest.raises(InvalidArgumentError, match=rf"^{name}="):
        long_doc_qa(**args)


def test_chain_ids_are_prefix_dependent():
    chain = _Chain()
    a = chain.ids([1, 2, 3])
    b = chain.ids([1, 2, 4])
    c = chain.ids([9, 2, 3])
    assert a[:2] == b[:2] and a[2] != b[2]
    assert not set(c) & set(a)  # same later content under another prefix: other ids
    assert chain.ids([1, 2, 3]) == a
    assert json.dumps(a)  # plain ints
