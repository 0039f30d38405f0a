"""Issue 38: the batched scheduler never parks a request while nothing runs.

- A sliding-window request whose cached prefix (device part locked, host part loaded back)
  needs more window slots than are reachable beside what its prefix locks, with nothing running:
  admitted at once (it used to wait forever: 2 waiting, 0 running after 3,000 steps).
- When no cached form fits (its prefix locks what it lacks), the head is begun with no prefix and
  computes it: bitwise equal to a no-cache run.
- A step with nothing running and nothing admitted is a stall: LivenessError under
  ``SchedulerConfig.debug``, counted and logged otherwise; never a silent spin.
- Random workloads on dense, sliding-window and hybrid-linear models, every write policy, faults
  at random in every copy and store call and copy jobs made slow or stalled at random (so that
  requests find copies in flight holding their pages), many seeds, in debug mode: every request
  finishes, bitwise, with no stall and no over-commit.
"""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest

import tests.engine.test_scheduler_hybrid as hybrid
from tests.cache._tree_util import one_torch_thread
from tests.engine.test_scheduler import MODEL as DENSE
from tiered_kv.cache import TieredKVCache
from tiered_kv.config import TieredKVConfig
from tiered_kv.engine.batch_state import SchedulerConfig
from tiered_kv.engine.budget import Budget
from tiered_kv.engine.prefix_probe import cached_prefix
from tiered_kv.engine.scheduler import Scheduler
from tiered_kv.errors import LivenessError

MODELS = {**hybrid.MODELS, "dense": DENSE}


def make_cache(tmp_path, kind: str, **changes) -> TieredKVCache:
    if kind != "dense":
        return hybrid.make_cache(tmp_path, kind, **changes)
    fields = dict(
        num_layers=DENSE.cfg.num_layers, head_num=DENSE.cfg.num_kv_heads,
        head_dim=DENSE.cfg.head_dim, page_size=hybrid.PAGE, device_tokens=160, host_tokens=320,
        storage_bytes=32 << 20, storage_path=str(tmp_path / "store"),
        prefetch_threshold=hybrid.PAGE, model_id="sched-dense@1", max_requests=8,
        max_context_len=512,
    )  # fmt: skip
    fields.update(changes)
    return TieredKVCache(TieredKVConfig.flat(**fields))


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 128) for _ in range(n)]


def steps_to_admit(sched: Scheduler, rid: int, limit: int = 30) -> int:
    for i in range(limit):
        if rid in sched.step().admitted:
            return i
    raise AssertionError(f"request {rid} not admitted in {limit} steps: {sched.stats}")


def test_a_host_hit_beyond_the_window_reach_is_admitted_alone(tmp_path):
    """Window pool 120 slots; a prefix of 40 device tokens (locked at begin) and 56 host
    tokens: the host hit and the request's window peak (56 + 48) fit the pool but not beside
    the locked prefix. Nothing else runs, so it is admitted in its first step."""
    cache = make_cache(tmp_path, "swa", storage_bytes=0)
    try:
        rng = random.Random(5)
        cfg = SchedulerConfig(chunk_size=16, record_logits=True, debug=True)
        sched = Scheduler(cache, MODELS["swa"], cfg)
        first = tokens(rng, 41)
        sched.add(first, 2)
        sched.run_until_done(100)
        second = first[:40] + tokens(rng, 57)
        sched.add(second, 2)
        sched.run_until_done(100)
        cache.drain()
        assert cache.manager.evict_device(56) == 56  # the second prompt's pages: host only
        prompt = second[:96] + tokens(rng, 7)
        device, host, _, locked = cached_prefix(cache, prompt[:-1])
        assert (device, host, locked) == (40, 56, 40)
        req = sched.add(prompt, 3)
        assert steps_to_admit(sched, req.rid) == 0
        sched.run_until_done(100)
        assert req.cached_tokens >= 40
        assert sched.stats.stalls == 0 and sched.stats.overcommits == 0
        hybrid.assert_bitwise(MODELS["swa"], sched.finished)
    finally:
        cache.close()


class LockedPrefixes:
    """A budget view in which whatever a cached prefix locks is exactly what the request
    lacks: any admission that locks device tokens does not fit."""

    def __init__(self, monkeypatch) -> None:
        real = Budget.fits
        self.refused = 0

        def fits(budget, need, locking=0):
            if locking:
                self.refused += 1
                return False
            return real(budget, need, locking)

        monkeypatch.setattr(Budget, "fits", fits)


@pytest.mark.parametrize("kind", ["dense", "swa", "hybrid"])
def test_no_cached_form_fits_so_the_head_computes_its_prefix(tmp_path, monkeypatch, kind):
    cache = make_cache(tmp_path, kind, storage_bytes=0)
    try:
        rng = random.Random(9)
        cfg = SchedulerConfig(chunk_size=16, record_logits=True, debug=True)
        sched = Scheduler(cache, MODELS[kind], cfg)
        system = tokens(rng, 40)
        sched.add(system + tokens(rng, 5), 3)
        sched.run_until_done(100)
        cache.drain()
        prompt = system + tokens(rng, 9)
        assert cached_prefix(cache, prompt[:-1]).unlocked_device > 0
        locked = LockedPrefixes(monkeypatch)
        req = sched.add(prompt, 4)
        assert steps_to_admit(sched, req.rid) == 0
        assert locked.refused > 0
        assert sched.stats.uncached_admissions == 1
        assert req.cached_tokens == 0  # computed whole
        sched.run_until_done(100)
        assert sched.stats.stalls == 0 and sched.stats.overcommits == 0
        hybrid.assert_bitwise(MODELS[kind], sched.finished)
        cache.manager.check_integrity()
    finally:
        cache.close()


def test_a_stall_raises_in_debug_mode_and_is_counted_otherwise(tmp_path, monkeypatch, caplog):
    """A budget that never fits (a leaked slot, say): the first idle step is a LivenessError
    naming the head's numbers in debug mode; otherwise every such step is counted and logged."""
    cache = make_cache(tmp_path, "dense", storage_bytes=0)
    try:
        monkeypatch.setattr(Budget, "fits", lambda budget, need, locking=0: False)
        debug = Scheduler(cache, DENSE, SchedulerConfig(chunk_size=16, debug=True))
        debug.add(tokens(random.Random(1), 20), 3)
        with pytest.raises(LivenessError, match=r"request 0: needs 32 full-side tokens"):
            debug.step()
        assert debug.stats.stalls == 1
        quiet = Scheduler(cache, DENSE, SchedulerConfig(chunk_size=16))
        quiet.add(tokens(random.Random(2), 20), 3)
        with caplog.at_level(logging.ERROR, logger="tiered_kv.engine.liveness"):
            for _ in range(3):
                assert quiet.step().admitted == ()
        assert quiet.stats.stalls == 3
        assert any("scheduler stall" in r.getMessage() for r in caplog.records)
    finally:
        cache.close()


def slow_copies(cache: TieredKVCache, seed: int) -> None:
    """Every device <-> host copy and store call sleeps now and then: mostly a few ms, one in
    twenty far longer (a stalled job), so the scheduler finds copies in flight holding pages."""
    rng, lock = random.Random(seed * 7919), threading.Lock()

    def wrap(obj, name):
        real = getattr(obj, name)

        def call(*args, **kwargs):
            with lock:
                roll = rng.random()
                delay = 0.15 * rng.random() if roll < 0.05 else 0.03 * rng.random()
            if roll < 0.4:
                time.sleep(delay)
            return real(*args, **kwargs)

        setattr(obj, name, call)

    for name in ("backup_from_device_all_layer", "load_to_device_per_layer"):
        wrap(cache.host_pool, name)
    store = getattr(cache.storage, "inner", None) or cache.storage
    for name in ("batch_get", "batch_set", "batch_exists"):
        if hasattr(store, name):
            wrap(store, name)


POLICIES = ("write_through", "write_back", "write_through_selective")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [21, 22, 23])
@pytest.mark.parametrize("kind", ["dense", "swa", "hybrid"])
def test_random_workloads_with_slow_copies_never_stall(tmp_path, kind, seed):
    t0 = time.monotonic()
    policy = POLICIES[(seed + len(kind)) % len(POLICIES)]
    cache = make_cache(tmp_path, kind, write_policy=policy)
    try:
        faults = hybrid.break_everything(cache, seed)
        slow_copies(cache, seed)
        with one_torch_thread():
            sched = hybrid.random_workload(cache, MODELS[kind], seed, 250)  # debug: stalls raise
    finally:
        cache.close()
    assert sum(faults.fired.values()) > 0
    assert sched.stats.stalls == 0 and sched.stats.overcommits == 0
    assert not sched.waiting and not sched.running
    assert all(len(r.output) == r.max_new_tokens for r in sched.finished)
    hybrid.assert_bitwise(MODELS[kind], sched.finished)
    print(kind, seed, policy, sched.stats, f"{time.monotonic() - t0:.0f} s")


def test_a_lone_head_whose_begun_prefix_fails_its_recheck_is_admitted_uncached_at_once(
    tmp_path, monkeypatch
):
    """The head, alone, is begun with its cached prefix and then no longer fits with what its
    begin really locked (a load evicted, say): it is aborted and, in the same step, begun with
    no prefix; no stall."""
    cache = make_cache(tmp_path, "dense", storage_bytes=0)
    try:
        rng = random.Random(4)
        cfg = SchedulerConfig(chunk_size=16, record_logits=True, debug=True)
        sched = Scheduler(cache, DENSE, cfg)
        system = tokens(rng, 40)
        sched.add(system + tokens(rng, 5), 3)
        sched.run_until_done(100)
        cache.drain()
        real_begin, real_fits = cache.begin_many, sched._fits
        recheck = {"fail": False}

        def begin_many(prompts, extra_keys=None, *, cached=True):
            recheck["fail"] = cached  # the re-check right after a cached begin fails
            return real_begin(prompts, extra_keys, cached=cached)

        def fits(need, locking=0):
            if recheck.pop("fail", False):
                return False
            return real_fits(need, locking)

        monkeypatch.setattr(cache, "begin_many", begin_many)
        monkeypatch.setattr(sched, "_fits", fits)
        req = sched.add(system + tokens(rng, 9), 4)
        assert req.rid in sched.step().admitted
        assert sched.stats.admission_recheck_failed == 1
        assert sched.stats.uncached_admissions == 1 and sched.stats.stalls == 0
        sched.run_until_done(100)
        hybrid.assert_bitwise(DENSE, sched.finished)
    finally:
        cache.close()
