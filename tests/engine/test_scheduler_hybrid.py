"""Issue 29: the batched scheduler on hybrid caches - a sliding-window model (window slots
budgeted beside full ones, window KV released by running requests, tombstones) and a
hybrid-linear model (state and tracking slots budgeted, snapshots restored through ``settle``).

Random workloads (700 steps, three seeds each) run on every tier - device, host and an LMDB
store - with faults injected at random into every device <-> host copy and every store call
(and, for the hybrid model, every state copy and state-store call): no allocation the budget
said fits is ever refused (0 over-commits), the slots add up after every step, and every finished
request's logits equal a no-cache run of the same model bit for bit (retracted and resumed
requests, and requests whose prefix load failed and were begun again, included)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from tests.cache._tree_util import one_torch_thread
from tests.cache.test_fault_campaign import Faults, inject
from tests.cache.test_state_fault_campaign import break_state_copies, break_state_store
from tiered_kv.cache import TieredKVCache
from tiered_kv.config import TieredKVConfig
from tiered_kv.engine.batch_state import ReqState, SchedulerConfig
from tiered_kv.engine.hybrid import DenseHybridKV, HybridModelConfig, TinyHybrid
from tiered_kv.engine.model import DenseKV
from tiered_kv.engine.scheduler import Scheduler
from tiered_kv.engine.swa import SWAModelConfig, TinySWA
from tiered_kv.errors import InvalidArgumentError

PAGE = 8
WINDOW = 13  # shorter than most prompts: requests release window KV, tombstones form
BASE = dict(vocab_size=128, hidden=32, num_layers=4, num_heads=2, num_kv_heads=2, head_dim=16)
SWA_CFG = SWAModelConfig(
    **BASE, intermediate=48, seed=11, sliding_window=WINDOW, full_layer_every=2
)
HYBRID_CFG = HybridModelConfig(
    **BASE, intermediate=48, seed=12, full_layer_every=2, conv_kernel=3, linear_heads=2,
    linear_key_dim=4, linear_value_dim=6,
)  # fmt: skip
MODELS = {"swa": TinySWA(SWA_CFG), "hybrid": TinyHybrid(HYBRID_CFG)}


def cache_fields(kind: str) -> dict:
    if kind == "swa":
        # The window side is smaller than the full side: its budget binds on its own.
        return dict(model="swa", sliding_window=WINDOW, full_layer_every=2, device_swa_tokens=120)
    return dict(
        model="hybrid_linear", full_layer_every=2, conv_kernel=3, linear_heads=2,
        linear_key_dim=4, linear_value_dim=6, state_snapshot_every=2,
        device_state_slots=14,  # six running requests' slots and a few snapshots beside them
    )  # fmt: skip


def make_cache(tmp_path, kind: str, **changes) -> TieredKVCache:
    fields = dict(
        num_layers=4, head_num=2, head_dim=16, page_size=PAGE, device_tokens=192,
        host_tokens=320, storage_bytes=32 << 20, storage_path=str(tmp_path / "store"),
        prefetch_threshold=PAGE, model_id=f"sched-{kind}@1", max_requests=8,
        max_context_len=512, **cache_fields(kind),
    )  # fmt: skip
    fields.update(changes)
    return TieredKVCache(TieredKVConfig.flat(**fields))


def break_everything(cache: TieredKVCache, seed: int) -> Faults:
    """Faults at random in every copy and store call (state ones too for a hybrid model)."""
    faults = Faults(seed, rate=0.05)
    inject(cache, faults, engine=False)
    if cache.states is not None:
        parts = [p for d in cache.req_to_token.state_pool_decls() for p in d.parts]
        break_state_copies(cache.states.ledger, parts, faults)
        break_state_store(cache.states.ledger, faults)
    return faults


def no_cache_logits(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    seq = prompt + output[:-1]
    cfg = model.cfg
    kv = DenseHybridKV(cfg, len(seq)) if hasattr(cfg, "conv_kernel") else DenseKV(cfg, len(seq))
    return model.forward(torch.tensor(seq), 0, kv, PAGE)[len(prompt) - 1 :]


def assert_bitwise(model, reqs) -> None:
    for r in reqs:
        served, ref = torch.stack(r.logits), no_cache_logits(model, r.prompt, r.output)
        assert served.shape == ref.shape, (r.rid, served.shape, ref.shape)
        assert torch.equal(served, ref), (r.rid, r.retractions, float((served - ref).abs().max()))


def window_slots_add_up(sched: Scheduler) -> None:
    """The window side: free + held by cached nodes + held by running requests = its size."""
    cache = sched.cache
    alloc = cache.allocator
    in_tree = sum(len(n) for n in cache.tree.nodes() if n.on_device and not n.windowless)
    own = 0
    for r in sched.running:
        req = r.cache_req
        start = max(req.window_freed, req.prefix_len)
        own += sched.budget.paged(len(req.tokens)) - start
    held = sched.drafts.held_tokens()
    total = alloc.swa_attn_allocator.size
    assert alloc.swa_available_size() + in_tree + own + held == total, (
        alloc.swa_available_size(),
        in_tree,
        own,
        total,
    )


def check_step(sched: Scheduler) -> None:
    sched.cache.manager.check_integrity(outside_device=sched.held_device_tokens())
    if sched.cache.manager.window is not None:
        window_slots_add_up(sched)
    assert sched.stats.overcommits == 0, sched.stats


def random_workload(cache, model, seed: int, steps: int):
    rng = random.Random(seed)
    cfg = SchedulerConfig(
        chunk_size=16, max_prefill_tokens=32, max_running=6, policy=rng.choice(
            ("fcfs", "cache_aware")
        ), max_wait_steps=20, record_logits=True, debug=True,
    )  # fmt: skip
    sched = Scheduler(cache, model, cfg)
    systems = [[rng.randrange(1, 128) for _ in range(rng.choice((8, 16, 24, 40)))] for _ in "abc"]
    for _ in range(steps):
        if rng.random() < 0.35 and len(sched.waiting) < 12:
            # The next turn of a finished conversation (its last window, or its state at its
            # end, is what makes it a hit), or a new one, most on a shared system prompt.
            done = [r for r in sched.finished if len(r.prompt) + len(r.output) < 80]
            if done and rng.random() < 0.4:
                last = rng.choice(done)
                head = last.prompt + last.output
            else:
                head = rng.choice(systems) if rng.random() < 0.7 else []
            tail = [rng.randrange(1, 128) for _ in range(rng.randrange(1, 40))]
            sched.add(head + tail, rng.randrange(1, 40))
        sched.step()
        check_step(sched)
    sched.run_until_done(3000)
    check_step(sched)
    # A closing burst whose decodes outgrow the device pool (6 requests of up to 79 tokens
    # against 192), so a retraction happens whatever the copies' timing left cached above.
    for _ in range(6):
        sched.add([rng.randrange(1, 128) for _ in range(rng.randrange(30, 40))], 39)
    for _ in range(3000):
        if not sched.waiting and not sched.running:
            break
        sched.step()
        check_step(sched)
    assert not sched.waiting and not sched.running, sched.stats
    return sched


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("kind", ["swa", "hybrid"])
def test_random_workload_under_faults_is_bitwise_and_never_overcommits(tmp_path, kind, seed):
    t0 = time.monotonic()
    policy = ("write_through", "write_back", "write_through")[seed - 1]
    cache = make_cache(tmp_path, kind, write_policy=policy)
    try:
        faults = break_everything(cache, seed)
        with one_torch_thread():  # the tiny model's ops are slower on two threads
            sched = random_workload(cache, MODELS[kind], seed, 700)
        st = cache.stats()
    finally:
        cache.close()
    assert sum(faults.fired.values()) > 0, "no fault was injected"
    assert sched.stats.overcommits == 0
    assert sched.stats.retracted > 0, "the pools were meant to be small enough to retract"
    assert any(c > 0 for r in sched.finished for c in r.resumed_cached)  # resumed from cache
    assert st["hits"]["device"] > 0 and st["hits"]["host"] > 0, st["hits"]
    assert all(len(r.output) == r.max_new_tokens for r in sched.finished)
    assert all(r.state is ReqState.FINISHED for r in sched.finished)
    if kind == "swa":
        assert st["window"]["released_tokens"] > 0, st["window"]
    assert_bitwise(MODELS[kind], sched.finished)
    print(kind, seed, sched.stats, {k: faults.fired[k] for k in sorted(faults.fired)})
    assert time.monotonic() - t0 < 240


def test_a_window_pool_too_small_for_one_request_is_refused(tmp_path):
    cache = make_cache(tmp_path, "swa", device_swa_tokens=32, storage_bytes=0)
    try:
        with pytest.raises(InvalidArgumentError, match="raise device_swa_tokens"):
            Scheduler(cache, MODELS["swa"], SchedulerConfig(chunk_size=16))
    finally:
        cache.close()


def test_the_window_budget_binds_before_the_full_one(tmp_path):
    """Six long prompts on a window side of 120 slots: admission stops at what the window side
    can hold though the full side has room for more, and nothing over-commits."""
    cache = make_cache(tmp_path, "swa", device_tokens=480, storage_bytes=0)
    try:
        cfg = SchedulerConfig(chunk_size=16, max_prefill_tokens=96, max_running=6)
        sched = Scheduler(cache, MODELS["swa"], cfg)
        for i in range(6):
            sched.add([(7 * i + j) % 127 + 1 for j in range(60)], 20)
        first = sched.step()
        assert 0 < len(first.admitted) < 6, first
        window = sched.budget.claims(sched.running).window
        assert window <= cache.allocator.swa_attn_allocator.size
        sched.run_until_done(400)
        assert sched.stats.overcommits == 0
    finally:
        cache.close()


def test_state_slots_bound_the_running_batch(tmp_path):
    """A hybrid cache with state slots for three requests (a state slot and a tracking slot
    each) runs at most three at once."""
    cache = make_cache(tmp_path, "hybrid", device_state_slots=6, storage_bytes=0)
    try:
        cfg = SchedulerConfig(chunk_size=16, max_running=6, record_logits=True)
        sched = Scheduler(cache, MODELS["hybrid"], cfg)
        assert sched.budget.state_per_request == 2
        for i in range(6):
            sched.add([(5 * i + j) % 127 + 1 for j in range(20)], 4)
        most = 0
        while sched.waiting or sched.running:
            sched.step()
            most = max(most, len(sched.running))
        assert most == 3
        assert_bitwise(MODELS["hybrid"], sched.finished)
    finally:
        cache.close()


def test_the_unified_window_pool_is_refused_by_name(tmp_path):
    cache = make_cache(
        tmp_path, "swa", device_swa_tokens=None, swa_unified_pool=True, storage_bytes=0
    )
    try:
        with pytest.raises(InvalidArgumentError, match="swa_unified_pool=False"):
            Scheduler(cache, MODELS["swa"], SchedulerConfig(chunk_size=16))
    finally:
        cache.close()
