"""Qwen/Bailian traces: the JSONL reader and writer, format detection, the generator's structure,
and ``tiered-kv sim`` on a Bailian file and on ``--generator bailian``."""

from __future__ import annotations

import json
import random
import re
import statistics
from collections import defaultdict

import pytest

from tiered_kv.cli.main import main
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.sim.bailian import (
    FIELDS,
    TYPES,
    BailianRecord,
    bailian,
    is_bailian,
    load_bailian,
    read_bailian,
    to_requests,
    write_bailian,
)
from tiered_kv.sim.traces import TraceRequest, unique_blocks

# The shape of a line of qwen_traceA_blksz_16.jsonl: a first turn and its follow-up.
LINES = [
    '{"chat_id": 159, "parent_chat_id": -1, "timestamp": 61.114, "input_length": 521, '
    '"output_length": 52, "type": "text", "turn": 1, "hash_ids": [1089, 1090, 1091, 6326, 13148, '
    "13149, 13150, 13151, 13152, 13153, 13154, 13155, 13156, 13157, 13158, 13159, 13160, 13161, "
    "13162, 13163, 13164, 13165, 13166, 13167, 13168, 13169, 13170, 13171, 13172, 13173, 13174, "
    "13175, 13176]}",
    '{"chat_id": 160, "parent_chat_id": -1, "timestamp": 60.5, "input_length": 40, '
    '"output_length": 7, "type": "search", "turn": 1, "hash_ids": [1, 2, 3]}',
    '{"chat_id": 170, "parent_chat_id": 159, "timestamp": 75.25, "input_length": 600, '
    '"output_length": 10, "type": "text", "turn": 2, "hash_ids": [1089, 1090, 1091, 6326, 13148, '
    "13149, 13150, 13151, 13152, 13153, 13154, 13155, 13156, 13157, 13158, 13159, 13160, 13161, "
    "13162, 13163, 13164, 13165, 13166, 13167, 13168, 13169, 13170, 13171, 13172, 13173, 13174, "
    "13175, 13176, 20001, 20002, 20003, 20004, 20005, 20006]}",
]


@pytest.fixture
def seed():
    return random.SystemRandom().randrange(1 << 32)


def _write(tmp_path, lines, name="trace.jsonl"):
    p = tmp_path / name
    p.write_text("".join(line + "\n" for line in lines))
    return p


# -- reader and writer ----------------------------------------------------------------------------
def test_round_trip_equals_the_generators_trace(tmp_path, seed):
    records = bailian(requests=300, seed=seed)
    path = tmp_path / "qwen.jsonl"
    write_bailian(records, path)
    assert read_bailian(path) == records, seed
    trace = load_bailian(path)
    assert trace == to_requests(records), seed
    assert [r.blocks for r in trace] == [r.hash_ids for r in records], seed
    assert [r.timestamp for r in trace] == [r.timestamp for r in records], seed
    assert [r.input_length for r in trace] == [r.input_length for r in records], seed
    assert [r.output_length for r in trace] == [r.output_length for r in records], seed
    assert set(json.loads(path.read_text().splitlines()[0])) == set(FIELDS)


def test_load_sorts_by_timestamp_keeps_ties_in_order_and_allows_cut_parents(tmp_path):
    tie = LINES[1].replace('"chat_id": 160', '"chat_id": 161').replace("[1, 2, 3]", "[9]")
    # 170's parent 159 comes later in the file, and 999 names no request at all: both allowed.
    cut = LINES[1].replace(
        '"chat_id": 160, "parent_chat_id": -1', '"chat_id": 5, "parent_chat_id": 999'
    )
    p = _write(tmp_path, [LINES[2], "", LINES[0], LINES[1], tie, "  ", cut])
    assert [r.chat_id for r in read_bailian(p)] == [170, 159, 160, 161, 5]
    trace = load_bailian(str(p))
    assert [r.timestamp for r in trace] == [60.5, 60.5, 60.5, 61.114, 75.25]
    assert [r.blocks for r in trace[:3]] == [(1, 2, 3), (9,), (1, 2, 3)]
    assert trace[3] == TraceRequest(tuple(json.loads(LINES[0])["hash_ids"]), 61.114, 52, 521)
    assert trace[4].blocks[:33] == trace[3].blocks


def _set(line: str, **fields) -> str:
    row = json.loads(line)
    for k, v in fields.items():
        if v is KeyError:
            del row[k]
        else:
            row[k] = v
    return json.dumps(row)


@pytest.mark.parametrize(
    "bad, field",
    [
        (_set(LINES[1], hash_ids=KeyError), "hash_ids"),
        (_set(LINES[1], hash_ids=[1, "2"]), "hash_ids"),
        (_set(LINES[1], hash_ids=[1, 2.0]), "hash_ids"),
        (_set(LINES[1], hash_ids=[True]), "hash_ids"),
        (_set(LINES[1], hash_ids="1 2"), "hash_ids"),
        (_set(LINES[1], chat_id="160"), "chat_id"),
        (_set(LINES[1], chat_id=-1), "chat_id"),
        (_set(LINES[1], chat_id=159), "chat_id=159"),  # line 1's
        (_set(LINES[1], chat_id=KeyError), "chat_id"),
        (_set(LINES[1], parent_chat_id=-2), "parent_chat_id=-2"),
        (_set(LINES[1], parent_chat_id=160), "parent_chat_id=160"),  # itself
        (_set(LINES[1], parent_chat_id=1.5), "parent_chat_id"),
        (_set(LINES[1], timestamp="noon"), "timestamp"),
        (_set(LINES[1], timestamp=float("nan")), "timestamp"),
        (_set(LINES[1], input_length=-1), "input_length"),
        (_set(LINES[1], output_length=None), "output_length"),
        (_set(LINES[1], type="video"), "type='video'"),
        (_set(LINES[1], turn=0), "turn"),
        ('{"chat_id": 1, "hash_ids": [1, 2', "Bailian"),  # bad JSON
        ("[1, 2, 3]", "chat_id"),  # not an object
    ],
)
def test_a_bad_line_is_a_typed_error_naming_file_line_and_field(tmp_path, bad, field):
    p = _write(tmp_path, [LINES[0], "", bad, LINES[2]])
    with pytest.raises(InvalidArgumentError) as exc:
        load_bailian(p)
    assert f"{p}:3:" in str(exc.value) and field in str(exc.value), str(exc.value)
    # Nothing half-loaded: the call returned nothing, and the file without that line loads whole.
    assert len(load_bailian(_write(tmp_path, [LINES[0], LINES[2]], "good.jsonl"))) == 2


def test_an_empty_file_is_an_error(tmp_path):
    for lines in ([], ["", "   "]):
        p = _write(tmp_path, lines)
        with pytest.raises(InvalidArgumentError, match="no requests"):
            load_bailian(p)


def test_format_detection_reads_the_first_non_empty_line(tmp_path):
    assert is_bailian(_write(tmp_path, ["", LINES[0]]))
    mooncake = '{"timestamp": 1, "input_length": 3, "output_length": 2, "hash_ids": [1]}'
    assert not is_bailian(_write(tmp_path, [mooncake, LINES[0]]))
    assert not is_bailian(_write(tmp_path, ["not json", LINES[0]]))
    assert not is_bailian(_write(tmp_path, []))


# -- the generator --------------------------------------------------------------------------------
def _conversations(records: list[BailianRecord]) -> dict[int, list[BailianRecord]]:
    """The records of each conversation (keyed by its first turn's chat_id), in turn order."""
    root: dict[int, int] = {}
    out: dict[int, list[BailianRecord]] = defaultdict(list)
    for r in records:
        root[r.chat_id] = r.chat_id if r.parent_chat_id == -1 else root[r.parent_chat_id]
        out[root[r.chat_id]].append(r)
    return out


def test_turns_chain_and_extend_the_parents_prompt(seed):
    records = bailian(requests=2000, seed=seed)
    assert len(records) == 2000 and [r.chat_id for r in records] == list(range(2000)), seed
    assert all(a.timestamp <= b.timestamp for a, b in zip(records, records[1:], strict=False)), seed
    by_id = {r.chat_id: r for r in records}
    for r in records:
        n = len(r.hash_ids)
        assert (n - 1) * 16 < r.input_length <= n * 16, (seed, r.chat_id)
        assert r.type in TYPES and r.output_length >= 1, (seed, r.chat_id)
        if r.parent_chat_id == -1:
            assert r.turn == 1, (seed, r.chat_id)
            continue
        p = by_id[r.parent_chat_id]
        assert p.chat_id < r.chat_id and p.timestamp < r.timestamp, (seed, r.chat_id)
        assert (r.turn, r.type) == (p.turn + 1, p.type), (seed, r.chat_id)
        assert r.hash_ids[: len(p.hash_ids)] == p.hash_ids, (seed, r.chat_id)
        # Then the parent's answer, whole blocks, then at least one new user block.
        assert n >= len(p.hash_ids) + -(-p.output_length // 16) + 1, (seed, r.chat_id)
    conversations = _conversations(records)
    assert max(r.turn for r in records) >= 4, seed
    assert len(conversations) > 400, (seed, len(conversations))
    # Conversations interleave in time: some start between another's turns.
    spans = sorted((c[0].chat_id, c[-1].chat_id) for c in conversations.values())
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False)), seed


def test_conversations_share_blocks_only_in_system_prompts(seed):
    records = bailian(requests=2000, seed=seed, system_prompts=3)
    conversations = _conversations(records)
    owners: dict[int, set[int]] = defaultdict(set)
    for key, turns in conversations.items():
        for r in turns:
            for b in r.hash_ids:
                owners[b].add(key)
    shared = {b for b, keys in owners.items() if len(keys) > 1}
    assert shared, seed
    prefixes: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    for turns in conversations.values():
        ids = turns[0].hash_ids
        lead = 0
        while lead < len(ids) and ids[lead] in shared:
            lead += 1
        # Shared blocks lead every prompt, the same run in every turn of the conversation.
        for r in turns:
            assert not shared & set(r.hash_ids[lead:]), (seed, r.chat_id)
        if lead:
            prefixes[turns[0].type].add(ids[:lead])
    assert 2 <= sum(len(p) for p in prefixes.values()) <= 3 * len(TYPES), (seed, prefixes.keys())
    assert all(len(p) <= 3 for p in prefixes.values()), seed
    # Whole conversations reuse their history: most block accesses are repeats.
    trace = to_requests(records)
    assert unique_blocks(trace) < 0.6 * sum(len(r.blocks) for r in trace), seed


def test_types_have_their_own_prompt_sizes_and_sizes_are_irregular(seed):
    records = bailian(requests=3000, seed=seed)
    first = defaultdict(list)
    for r in records:
        if r.turn == 1:
            first[r.type].append(len(r.hash_ids))
    assert set(first) == set(TYPES), seed
    median = {t: statistics.median(v) for t, v in first.items()}
    assert median["search"] > 3 * median["text"], (seed, median)
    assert median["file"] > 3 * median["text"], (seed, median)
    assert median["image"] > 64, (seed, median)  # an image is a run of at least 64 blocks
    assert len({len(r.hash_ids) for r in records}) > 500, seed
    assert len({r.input_length % 16 for r in records}) == 16, seed  # partial last blocks


def test_a_4000_request_trace_fits_its_requests_in_5_percent(seed):
    """bench_policies.py's sizing: a prefix cache cannot keep a request larger than the
    device, so the longest prompt must fit 5% of the unique blocks."""
    trace = to_requests(bailian(requests=4000, seed=seed))
    assert max(len(r.blocks) for r in trace) <= 2048 <= 0.05 * unique_blocks(trace), seed


def test_deterministic_per_seed_and_seeds_differ(seed):
    a = bailian(requests=500, seed=seed)
    assert a == bailian(requests=500, seed=seed), seed
    assert a != bailian(requests=500, seed=seed + 1), seed


def test_block_size_and_prompt_cap(seed):
    records = bailian(requests=800, seed=seed, block_size=32, max_prompt_tokens=8192)
    for r in records:
        n = len(r.hash_ids)
        assert n <= 256 and (n - 1) * 32 < r.input_length <= n * 32, (seed, r.chat_id)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"requests": 0}, "requests=0"),
        ({"block_size": 0}, "block_size=0"),
        ({"system_prompts": True}, "system_prompts=True"),
        ({"type_weights": (1, 1, 1)}, "type_weights"),
        ({"type_weights": (0, 0, 0, 0)}, "type_weights"),
        ({"mean_turns": 0.5}, "mean_turns=0.5"),
        ({"mean_gap_s": 0}, "mean_gap_s=0"),
        ({"max_prompt_tokens": 512}, "max_prompt_tokens=512"),
    ],
)
def test_bad_generator_arguments_are_named(kwargs, named):
    with pytest.raises(InvalidArgumentError, match=named.replace("(", r"\(")):
        bailian(**kwargs)


# -- the CLI --------------------------------------------------------------------------------------
SIM = ["sim", "--no-progress", "--jobs", "1", "--capacities", "0.2,0.5", "--policies", "lru,fifo"]


def test_sim_replays_a_bailian_file(tmp_path, capsys, seed):
    records = bailian(requests=150, seed=seed)
    trace_path, out = tmp_path / "qwen_trace.jsonl", tmp_path / "sim.json"
    write_bailian(records, trace_path)
    trace = to_requests(records)
    accesses = sum(len(r.blocks) for r in trace)
    for fmt in ("auto", "bailian", "mooncake"):  # a Mooncake reader takes its hash_ids too
        argv = [*SIM, "--trace", str(trace_path), "--trace-format", fmt, "--json", str(out)]
        assert main(argv) == 0, (seed, fmt)
        res = json.loads(out.read_text())
        assert res["source"] == str(trace_path)
        assert (res["requests"], res["accesses"]) == (150, accesses), (seed, fmt)
        assert res["unique_blocks"] == unique_blocks(trace), (seed, fmt)
        assert len(res["rows"]) == 4 and all(0 <= r["hit_rate"] <= 1 for r in res["rows"])
        assert any(r["hit_rate"] > 0 for r in res["rows"]), (seed, fmt)
    assert f"{trace_path}: 150 requests, {accesses} block accesses" in capsys.readouterr().out


def test_sim_forced_bailian_on_a_mooncake_file_is_a_clean_error(tmp_path, capsys):
    p = _write(
        tmp_path, ['{"timestamp": 1, "input_length": 3, "output_length": 2, "hash_ids": [1]}']
    )
    with pytest.raises(SystemExit) as info:
        main([*SIM, "--trace", str(p), "--trace-format", "bailian"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert f"{p}:1:" in err and "missing chat_id" in err, err


def test_sim_generator_bailian(tmp_path, capsys, seed):
    out = tmp_path / "sim.json"
    argv = [*SIM, "--generator", "bailian", "--requests", "120", "--seed", str(seed)]
    assert main([*argv, "--json", str(out)]) == 0, seed
    res = json.loads(out.read_text())
    trace = to_requests(bailian(requests=120, seed=seed))
    assert res["source"] == "bailian"
    assert res["requests"] == 120 and res["accesses"] == sum(len(r.blocks) for r in trace), seed
    assert res["unique_blocks"] == unique_blocks(trace), seed


def test_readers_refuse_a_file_that_is_not_utf8_with_a_typed_error(tmp_path):
    """Issue 38: a trace that is not UTF-8 (a binary or compressed file, a bad byte in a line)
    raises InvalidArgumentError (a TieredKVError) naming the file and the line, from every
    reader, whatever the locale's encoding; never UnicodeDecodeError."""
    from tiered_kv.errors import TieredKVError
    from tiered_kv.sim.traces import load_mooncake

    p = tmp_path / "trace.jsonl"
    p.write_bytes((LINES[0] + "\n").encode() + b'{"chat_id": "\xe9t\xe9"}\n')
    for read in (read_bailian, load_bailian, load_mooncake):
        with pytest.raises(InvalidArgumentError, match=re.escape(f"{p}:2: not UTF-8")) as info:
            read(p)
        assert isinstance(info.value, TieredKVError) and info.value.__cause__ is None
    assert is_bailian(p)  # its first line is fine
    p.write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(128, 256)))
    for read in (read_bailian, is_bailian, load_mooncake):
        with pytest.raises(InvalidArgumentError, match=re.escape(f"{p}:1: not UTF-8") + ".*gzip"):
            read(p)
