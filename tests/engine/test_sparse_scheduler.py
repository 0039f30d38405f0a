"""Issue 29: the batched scheduler on a DSA cache with HiSparse (``SparseScheduler``).

Random workloads (700 steps, three seeds) run sparse requests over a device pool that holds
only their fixed buffers and prefill staging rows, a host tier and an LMDB store, with faults
injected at random into every device <-> host copy (staging loads, admit and commit backups),
every swap-in copy and every store call: the device and logical budgets are never over-committed
(a begin refused for device room the budget said was there is counted), the device, logical and
host slots add up after every step, and every finished request's logits equal a no-cache run of
the same model bit for bit (retracted and resumed requests, and requests whose admit failed and
were begun again, included)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from tests.cache._tree_util import one_torch_thread
from tests.cache.test_fault_campaign import Faults, InjectedCopyFault, inject
from tiered_kv.cache import TieredKVCache
from tiered_kv.cache.hisparse_serving import HiSparseServing
from tiered_kv.config import TieredKVConfig
from tiered_kv.engine.batch_state import ReqState, SchedulerConfig
from tiered_kv.engine.dsa import DenseDSAKV, DSAModelConfig
from tiered_kv.engine.hisparse_model import SparseDSA
from tiered_kv.engine.sparse_scheduler import SparseScheduler
from tiered_kv.errors import InvalidArgumentError, LivenessError
from tiered_kv.host.layer_rows import LayerRowLoader

PAGE = 4
BUFFER = 8
CFG = DSAModelConfig(
    vocab_size=128, hidden=32, num_layers=2, num_heads=2, intermediate=48, seed=21,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
    index_head_dim=128, index_topk=6,
)  # fmt: skip
MODEL = SparseDSA(CFG)


def make_cache(tmp_path, **changes) -> TieredKVCache:
    fields = dict(
        model="dsa", num_layers=CFG.num_layers, kv_lora_rank=CFG.kv_lora_rank,
        qk_rope_head_dim=CFG.qk_rope_head_dim, index_head_dim=CFG.index_head_dim,
        dtype="float32", page_size=PAGE, device_tokens=192, hisparse_logical_ratio=4,
        host_tokens=256, storage_bytes=32 << 20, storage_path=str(tmp_path / "store"),
        prefetch_threshold=PAGE, model_id="sched-dsa@1", max_requests=8, max_context_len=256,
    )  # fmt: skip
    fields.update(changes)
    return TieredKVCache(TieredKVConfig.flat(**fields))


def break_sparse_copies(cache: TieredKVCache, faults: Faults, monkeypatch) -> None:
    """Beyond ``inject``: the staging loads (every layer at once) and swap-in copies fail at
    random, half of them after copying wrong rows."""
    host = cache.host_pool
    real_all = host.load_to_device_all_layer

    def load_all(pool, host_indices, device_indices, io_backend="kernel"):
        draw = faults.roll("load_all_layers")
        if draw is not None:
            if draw < 0.5:
                real_all(pool, host_indices.flip(0), device_indices, io_backend)
            raise InjectedCopyFault("load_to_device_all_layer")
        real_all(pool, host_indices, device_indices, io_backend)

    host.load_to_device_all_layer = load_all
    real_rows = LayerRowLoader.load

    def rows(self, layer_id, host_slots, dev_rows):
        draw = faults.roll("swap_in_copy", faults.rate / 2)
        if draw is not None:
            if draw < 0.5 and len(host_slots) > 1:
                real_rows(self, layer_id, host_slots[::-1].copy(), dev_rows)
            raise InjectedCopyFault("swap-in")
        real_rows(self, layer_id, host_slots, dev_rows)

    monkeypatch.setattr(LayerRowLoader, "load", rows)


def no_cache_logits(prompt: list[int], output: list[int]) -> torch.Tensor:
    seq = prompt + output[:-1]
    return MODEL.forward(torch.tensor(seq), 0, DenseDSAKV(CFG, len(seq)), PAGE)[len(prompt) - 1 :]


def slots_add_up(sched: SparseScheduler) -> None:
    cache, alloc = sched.cache, sched.allocator
    device, logical, host = sched.held_slots()
    cache.manager.check_integrity(outside_device=device, outside_host=host)
    in_tree = cache.tree.device_tokens  # the tree's device nodes hold logical ids too
    assert alloc.logical_available_size() + in_tree + logical == cache._initial_logical
    assert sched.serving.counts["refused_device"] == 0, sched.serving.counts


def random_workload(cache, seed: int, steps: int) -> SparseScheduler:
    rng = random.Random(seed)
    serving = HiSparseServing(cache, BUFFER)
    cfg = SchedulerConfig(
        chunk_size=16, max_prefill_tokens=48, max_running=4, record_logits=True, debug=True
    )
    sched = SparseScheduler(serving, MODEL, cfg)
    systems = [[rng.randrange(1, 128) for _ in range(rng.choice((8, 16, 27, 40)))] for _ in "ab"]
    for _ in range(steps):
        if rng.random() < 0.3 and len(sched.waiting) < 10:
            done = [r for r in sched.finished if len(r.prompt) + len(r.output) < 90]
            if done and rng.random() < 0.4:  # the next turn of a finished conversation
                last = rng.choice(done)
                head = last.prompt + last.output
            else:
                head = rng.choice(systems) if rng.random() < 0.7 else []
            tail = [rng.randrange(1, 128) for _ in range(rng.randrange(1, 30))]
            sched.add(head + tail, rng.randrange(1, 30))
        sched.step()
        slots_add_up(sched)
    sched.run_until_done(3000)
    slots_add_up(sched)
    return sched


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_sparse_workload_under_faults_is_bitwise(tmp_path, seed, monkeypatch):
    t0 = time.monotonic()
    policy = ("write_through", "write_back", "write_through")[seed - 1]
    cache = make_cache(tmp_path, write_policy=policy)
    cache._initial_logical = cache.allocator.logical_available_size()
    try:
        faults = Faults(seed, rate=0.05)
        inject(cache, faults, engine=False)
        break_sparse_copies(cache, faults, monkeypatch)
        with one_torch_thread():
            sched = random_workload(cache, seed, 700)
        st, counts = cache.stats(), dict(sched.serving.counts)
    finally:
        cache.close()
    print(seed, sched.stats, counts, st["hits"], {k: faults.fired[k] for k in sorted(faults.fired)})
    for point in ("load_all_layers", "swap_in_copy", "backup_from_device"):
        assert faults.fired.get(point, 0) > 0, (point, faults.fired)
    assert sched.stats.retracted > 0, "the host tier was meant to be small enough to retract"
    assert any(c > 0 for r in sched.finished for c in r.resumed_cached)  # resumed from cache
    assert st["hits"]["host"] > 0 and counts["prefix_tokens"] > 0, st["hits"]
    assert counts["admit_failed"] > 0 and counts["prefix_load_failed"] > 0, counts
    assert all(len(r.output) == r.max_new_tokens for r in sched.finished)
    assert all(r.state is ReqState.FINISHED for r in sched.finished)
    for r in sched.finished:
        served, ref = torch.stack(r.logits), no_cache_logits(r.prompt, r.output)
        assert torch.equal(served, ref), (r.rid, r.retractions, float((served - ref).abs().max()))
    assert time.monotonic() - t0 < 600  # 93-183 s at load 4-7 on 2 cores


def test_a_request_that_cannot_fit_is_refused_by_name(tmp_path):
    cache = make_cache(tmp_path, storage_bytes=0)
    try:
        sched = SparseScheduler(HiSparseServing(cache, BUFFER), MODEL, SchedulerConfig(16))
        with pytest.raises(InvalidArgumentError, match="staging rows"):
            sched.add(list(range(1, 200)), 20)  # 219 tokens > 192 device slots
        with pytest.raises(InvalidArgumentError, match="max_context_len"):
            sched.add([1] * 200, 100)
        with pytest.raises(InvalidArgumentError, match="SparseDSA"):
            SparseScheduler(HiSparseServing(cache, BUFFER), object(), SchedulerConfig(16))
        with pytest.raises(InvalidArgumentError, match="buffer"):
            SparseScheduler(HiSparseServing(cache, 192), MODEL, SchedulerConfig(16))
    finally:
        cache.close()


def test_a_sparse_step_that_admits_nothing_alone_is_a_stall(tmp_path, monkeypatch):
    """Issue 38: nothing runs and the head's begin finds no room after all (a stand-in for a
    leaked slot): LivenessError at once in debug mode, counted every step otherwise."""
    cache = make_cache(tmp_path, storage_bytes=0)
    try:
        serving = HiSparseServing(cache, BUFFER)
        monkeypatch.setattr(serving, "begin", lambda tokens, extra_key=None: None)
        debug = SparseScheduler(serving, MODEL, SchedulerConfig(16, debug=True))
        debug.add([random.randrange(1, 128) for _ in range(13)], 3)
        with pytest.raises(LivenessError, match="request 0: 13 tokens"):
            debug.step()
        quiet = SparseScheduler(serving, MODEL, SchedulerConfig(16))
        quiet.add([random.randrange(1, 128) for _ in range(13)], 3)
        for _ in range(2):
            assert quiet.step().admitted == ()
        assert quiet.stats.stalls == 2
    finally:
        cache.close()
