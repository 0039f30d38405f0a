"""The two halves together over real tiers: the scheduler half's metadata drives the worker
half's layer-wise saves and its async or layer-wise loads; a layer's blocks are in place when
``wait_for_layer_load`` returns; a load that cannot be served is reported and saved again."""

from __future__ import annotations

import hashlib
import random
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from tiered_kv.integrations.vllm import worker_side
from tiered_kv.integrations.vllm.block_layout import describe_layers
from tiered_kv.integrations.vllm.metadata import RankReport, TieredKVWorkerMeta
from tiered_kv.integrations.vllm.scheduler_side import SchedulerSide
from tiered_kv.integrations.vllm.scheduler_tiers import SchedulerTiers
from tiered_kv.integrations.vllm.settings import read_settings
from tiered_kv.integrations.vllm.tiers import ConnectorTiers
from tiered_kv.integrations.vllm.worker_side import WorkerSide, idle_step, wait_if_idle

from ._kv import block_bytes, make_caches, page_bytes, refill_
from ._sched import (
    Blocks,
    CachedReqs,
    ConnectorOutput,
    NewReq,
    Request,
    SchedulerOutput,
    digests_of,
    tokens,
)

NB, H, BS, D = 12, 2, 4, 6
KIND = "LBNHC"


class Pair:
    def __init__(self, tmp_path, gen, load_async: bool) -> None:
        self.gen = gen
        caches, self.physical = make_caches(KIND, [0, 1, 2], NB, H, BS, D, gen)
        self.layout = describe_layers(caches, NB)
        settings = read_settings(
            {
                "model_id": "org/tiny@rev1",
                "storage_path": str(tmp_path / "store"),
                "storage_bytes": 64 << 20,
                "host_bytes": 8 * self.layout.page_nbytes,
                "load_mode": "async" if load_async else "layerwise",
            }
        )
        self.tiers = ConnectorTiers(settings, self.layout, rank=None)
        self.worker = WorkerSide(self.tiers, settings.load_async)
        self.sched_tiers = SchedulerTiers(settings)
        self.owned: dict[str, list[int]] = {}
        self.sched = SchedulerSide(
            BS, settings.load_async, self.sched_tiers.lookup, lambda r: self.owned.get(r, [])
        )

    def report(self) -> None:
        self.tiers.drain()
        changes = self.tiers.slots.take_changes()
        report = RankReport(self.tiers.namespace, self.layout.page_nbytes, changes)
        meta = TieredKVWorkerMeta({(None, 0): report})
        self.sched_tiers.apply(meta)

    def forward(self, meta) -> None:
        """One step's forward as vLLM runs it: loads started, each layer waited for, computed
        (here: nothing) and saved."""
        self.worker.start_load_kv(meta)
        self.worker.begin_saves(meta)
        for name in self.layout.layer_names:
            self.worker.wait_for_layer_load(name)
            self.worker.save_kv_layer(name)
        self.worker.wait_for_save()
        self.worker.finish_step_loads()

    def page(self, block):
        return page_bytes(KIND, self.physical, block)

    def close(self):
        self.worker.shutdown()
        self.sched_tiers.close()


@pytest.fixture(params=[True, False], ids=["async", "layerwise"])
def pair(request, tmp_path, gen):
    p = Pair(tmp_path, gen, request.param)
    yield p
    p.close()


def _finished(worker, req_id, timeout=10.0):
    deadline = time.monotonic() + timeout
    done: set[str] = set()
    while req_id not in done:
        done |= worker.get_finished()
        assert time.monotonic() < deadline, "an async load never finished"
        time.sleep(0.001)
    return done


def test_saved_by_one_request_loaded_by_the_next(pair, gen):
    p = pair
    a = Request("a", tokens(gen, 3 * BS + 1))
    d = digests_of(a, BS)
    assert p.sched.get_num_new_matched_tokens(a, 0) == (0, False)  # no worker report yet
    p.owned["a"] = [3, 7, 5, 1]
    meta = p.sched.build_connector_meta(
        SchedulerOutput([NewReq("a", 0)], num_scheduled_tokens={"a": 3 * BS + 1})
    )
    assert [s.blocks for s in meta.saves] == [[3, 7, 5]]
    want = [p.page(b) for b in (3, 7, 5)]
    p.forward(meta)
    p.report()

    b = Request("b", list(a.all_token_ids) + tokens(gen, 2))
    assert p.sched.get_num_new_matched_tokens(b, 0) == (3 * BS, p.worker.load_async)
    p.owned["b"] = [8, 2, 10, 4]
    p.sched.update_state_after_alloc(b, Blocks(p.owned["b"]), 3 * BS)
    refill_(p.physical, gen)
    meta = p.sched.build_connector_meta(SchedulerOutput())
    assert [ld.blocks for ld in meta.loads] == [[8, 2, 10]]
    assert [ld.digests for ld in meta.loads] == [d[:3]]
    if p.worker.load_async:
        p.worker.start_load_kv(meta)
        _finished(p.worker, "b")
    else:
        p.worker.start_load_kv(meta)
        for li, name in enumerate(p.layout.layer_names):
            p.worker.wait_for_layer_load(name)
            # the hazard: this layer's attention reads the blocks now
            layer = p.physical[p.layout.layer_ids[li]]
            for t, w in zip([8, 2, 10], want, strict=True):
                n = w.numel() // len(p.layout.layer_ids)
                assert torch.equal(block_bytes(KIND, layer, t)[0], w[li * n : (li + 1) * n])
        p.worker.finish_step_loads()
    assert p.worker.load_errors() == set()
    for t, w in zip([8, 2, 10], want, strict=True):
        assert torch.equal(p.page(t), w)


def test_a_lost_page_is_reported_and_saved_again(pair, gen):
    p = pair
    a = Request("a", tokens(gen, 4 * BS + 1))
    d = digests_of(a, BS)
    assert p.sched.get_num_new_matched_tokens(a, 0) == (0, False)
    p.owned["a"] = [1, 2, 3, 4, 5]
    p.forward(
        p.sched.build_connector_meta(
            SchedulerOutput([NewReq("a", 0)], num_scheduled_tokens={"a": 4 * BS + 1})
        )
    )
    p.report()
    b = Request("b", list(a.all_token_ids))
    assert p.sched.get_num_new_matched_tokens(b, 0) == (4 * BS, p.worker.load_async)
    # the page of block 2 leaves both tiers after the lookup
    p.tiers.store.delete(p.tiers.keys(d[1:2]))
    slot = p.tiers.slots.pin_cached(d[1])
    p.tiers.slots.forget(slot)
    p.tiers.slots.unpin(slot)
    p.owned["b"] = [9, 6, 11, 7, 10]
    p.sched.update_state_after_alloc(b, Blocks(p.owned["b"]), 4 * BS)
    meta = p.sched.build_connector_meta(SchedulerOutput())
    if p.worker.load_async:
        p.worker.start_load_kv(meta)
        _finished(p.worker, "b")
    else:
        p.forward(meta)
    bad = p.worker.load_errors()
    assert bad == {6, 11, 7}
    p.sched.update_connector_output(ConnectorOutput(invalid_block_ids=bad, finished_recving={"b"}))
    # vLLM recomputes from block 6 on; those blocks are saved again
    again = p.sched.build_connector_meta(
        SchedulerOutput(
            scheduled_cached_reqs=CachedReqs(["b"], [BS]), num_scheduled_tokens={"b": 3 * BS + 1}
        )
    )
    assert [(s.blocks, s.digests) for s in again.saves] == [([6, 11, 7], d[1:4])]


def test_a_steps_layerwise_loads_take_host_slots_before_its_saves(tmp_path, gen):
    """A host tier of 8 pages, a step loading 6 pages from the store and saving 5 new ones:
    the loads get their slots (a load without one costs a hit now), the saves what is left or
    done with. (Saves that took their slots when the step's metadata was bound starved them.)"""
    from tiered_kv.integrations.vllm.metadata import BlockPages, TieredKVMetadata

    p = Pair(tmp_path, gen, load_async=False)
    try:
        old = [bytes([7, i]) * 16 for i in range(6)]
        p.forward(TieredKVMetadata(saves=[BlockPages("a", [1, 2, 3, 4, 5, 6], old)]))
        p.tiers.drain()
        want = [p.page(b) for b in (1, 2, 3, 4, 5, 6)]
        for d in old:  # the pages leave the host tier; the store keeps them
            slot = p.tiers.slots.pin_cached(d)
            p.tiers.slots.forget(slot)
            p.tiers.slots.unpin(slot)
        refill_(p.physical, gen)
        new = [bytes([9, i]) * 16 for i in range(5)]
        step = TieredKVMetadata(
            loads=[BlockPages("b", [7, 8, 9, 10, 11, 6], old)],
            saves=[BlockPages("c", [1, 2, 3, 4, 5], new)],
        )
        p.worker.begin_saves(step)  # as vLLM binds the step's metadata: before the loads start
        p.forward(step)
        assert p.worker.load_errors() == set()
        for block, w in zip([7, 8, 9, 10, 11, 6], want, strict=True):
            assert torch.equal(p.page(block), w)
        c = p.tiers.counters.snapshot()
        assert c["loaded_store_blocks"] == 6  # the saves took what was free or done with
    finally:
        p.close()


def test_a_failed_layerwise_load_drops_the_steps_saves(tmp_path, gen):
    """A layer-wise load fails in a step: the forward read a block never filled, so every block
    that step computed (its saves, of every request: a shared block could carry it) is dropped,
    never named on the host or written to the store."""
    from tiered_kv.integrations.vllm.metadata import BlockPages, TieredKVMetadata

    p = Pair(tmp_path, gen, load_async=False)
    try:
        missing = [bytes([5, i]) * 16 for i in range(2)]  # never stored: the load fails
        computed = [bytes([6, i]) * 16 for i in range(3)]
        step = TieredKVMetadata(
            loads=[BlockPages("b", [7, 8], missing)],
            saves=[BlockPages("b", [9], computed[:1]), BlockPages("c", [1, 2], computed[1:])],
        )
        p.worker.begin_saves(step)
        p.forward(step)
        assert p.worker.load_errors() == {7, 8}
        p.tiers.drain()
        assert p.tiers.slots.lookup(computed[:1]) == 0
        assert all(p.tiers.slots.lookup([d]) == 0 for d in computed)
        assert p.tiers.store.batch_exists(p.tiers.keys(computed[1:])) == 0
        c = p.tiers.counters.snapshot()
        assert c["save_dropped_blocks"] == 3 and c["saved_blocks"] == 0
        assert p.tiers.slots.counts()["pinned"] == 0
        # the next step, with no failed load, saves again
        p.worker.begin_saves(TieredKVMetadata(saves=[BlockPages("c", [1, 2], computed[1:])]))
        p.forward(TieredKVMetadata(saves=[BlockPages("c", [1, 2], computed[1:])]))
        p.tiers.drain()
        assert p.tiers.store.batch_exists(p.tiers.keys(computed[1:])) == 2
    finally:
        p.close()


# -- a step with nothing to compute waits a little for the loads in flight --------------------
def test_idle_step_is_read_from_the_forward_context():
    class Ctx:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    assert idle_step(Ctx(attn_metadata=None))  # vLLM's no-forward step
    assert not idle_step(Ctx(attn_metadata={"layer.0": object()}))
    assert not idle_step(Ctx(attn_metadata={}))
    assert not idle_step(Ctx())  # a context that does not say is a forward's
    assert not idle_step(None)


def test_wait_if_idle_waits_only_in_an_idle_step_and_only_as_long_as_allowed():
    never: Future = Future()
    t = time.monotonic()
    wait_if_idle(False, [never])
    wait_if_idle(True, [])
    assert time.monotonic() - t < worker_side.IDLE_WAIT_S  # nothing to wait for: no wait
    t = time.monotonic()
    wait_if_idle(True, [never])  # a load that does not finish: the bound
    assert worker_side.IDLE_WAIT_S * 0.9 <= time.monotonic() - t < 5.0
    soon: Future = Future()
    threading.Timer(0.05, soon.set_result, (set(),)).start()
    t = time.monotonic()
    with_bound = worker_side.IDLE_WAIT_S
    try:
        worker_side.IDLE_WAIT_S = 30.0
        wait_if_idle(True, [never, soon])  # returns with the first one done, not at the bound
    finally:
        worker_side.IDLE_WAIT_S = with_bound
    assert soon.done() and time.monotonic() - t < 20.0


@pytest.mark.parametrize("idle", [True, False], ids=["idle-step", "forward-step"])
def test_an_idle_step_reports_a_load_that_finishes_while_it_waits(tmp_path, gen, monkeypatch, idle):
    """With the wait long, an idle step's ``get_finished`` returns the load it started; a step
    with a forward never waits (vLLM asks again after the next forward)."""
    p = Pair(tmp_path, gen, load_async=True)
    try:
        a = Request("a", tokens(gen, 3 * BS + 1))
        assert p.sched.get_num_new_matched_tokens(a, 0) == (0, False)
        p.owned["a"] = [3, 7, 5, 1]
        p.forward(
            p.sched.build_connector_meta(
                SchedulerOutput([NewReq("a", 0)], num_scheduled_tokens={"a": 3 * BS + 1})
            )
        )
        p.report()
        want = [p.page(b) for b in (3, 7, 5)]
        b = Request("b", list(a.all_token_ids) + tokens(gen, 2))
        assert p.sched.get_num_new_matched_tokens(b, 0) == (3 * BS, True)
        p.owned["b"] = [8, 2, 10, 4]
        p.sched.update_state_after_alloc(b, Blocks(p.owned["b"]), 3 * BS)
        refill_(p.physical, gen)
        meta = p.sched.build_connector_meta(SchedulerOutput())
        gate = threading.Event()
        p.tiers.submit(lambda: gate.wait(30) and set())  # the load queues behind this
        monkeypatch.setattr(worker_side, "IDLE_WAIT_S", 30.0)
        p.worker.start_load_kv(meta, idle=idle)
        if idle:
            threading.Timer(0.05, gate.set).start()
            assert p.worker.get_finished() == {"b"}  # waited for it: no second step needed
        else:
            t = time.monotonic()
            assert p.worker.get_finished() == set()  # held back by the gate; no wait
            assert time.monotonic() - t < 5.0
            gate.set()
            _finished(p.worker, "b")
        assert p.worker.load_errors() == set()
        for t_block, w in zip([8, 2, 10], want, strict=True):
            assert torch.equal(p.page(t_block), w)
    finally:
        p.close()


def test_random_faults_through_idle_and_forward_steps_never_serve_wrong_bytes(tmp_path, gen):
    """Async loads of several requests at once, most on one shared prefix, reported through
    steps that are idle (they wait for a load in flight) or not, with the store's reads and
    writes and the copier failing at random: every block reported loaded holds the bytes saved
    under its digest, every failure is the tail of its request's chain, and each request is
    reported once."""
    from tiered_kv.integrations.vllm.metadata import BlockPages, TieredKVMetadata

    from .test_vllm_tiers import Faults

    rng = random.Random(int(torch.randint(1 << 30, (1,), generator=gen)))
    p = Pair(tmp_path, gen, load_async=True)
    faults = Faults(p.tiers, rng, gen)
    truth: dict[bytes, torch.Tensor] = {}
    served = failed_total = 0
    try:
        for step in range(150):
            blocks = rng.sample(range(NB), rng.randint(1, 3))
            refill_(p.physical, gen)
            digests = [hashlib.sha256(f"{step}/{b}".encode()).digest() for b in blocks]
            for b, d in zip(blocks, digests, strict=True):
                truth[d] = p.page(b)
            save = p.tiers.begin_save(blocks, digests)
            fut = p.tiers.finish_save(save)
            if fut is not None:
                fut.result()
            known = list(truth)
            shared = known[-3:]  # the newest pages: a prefix several requests ask for
            targets = rng.sample(range(NB), NB)
            loads, want = [], {}
            for r in range(rng.randint(1, 3)):
                chain = shared[: rng.randint(1, len(shared))] if rng.random() < 0.7 else []
                chain += [rng.choice(known) for _ in range(rng.randint(0, 2))]
                chain = list(dict.fromkeys(chain))[: len(targets)]
                if not chain:
                    continue
                mine, targets = targets[: len(chain)], targets[len(chain) :]
                loads.append(BlockPages(f"{step}-{r}", mine, chain))
                want[f"{step}-{r}"] = (mine, chain)
            refill_(p.physical, gen)
            p.worker.start_load_kv(TieredKVMetadata(loads=loads), idle=rng.random() < 0.5)
            reported: set[str] = set()
            deadline = time.monotonic() + 30
            while reported != set(want):
                got = p.worker.get_finished()
                assert not (got & reported), "a request reported twice"
                reported |= got
                assert time.monotonic() < deadline, "a load never finished"
                p.worker._idle = rng.random() < 0.5  # the next step: idle or a forward
            errors = p.worker.load_errors()
            for mine, chain in want.values():
                bad = [i for i, b in enumerate(mine) if b in errors]
                ok = bad[0] if bad else len(mine)
                assert bad == list(range(ok, len(mine))), (mine, errors)  # failures: a tail
                for b, d in zip(mine[:ok], chain[:ok], strict=True):
                    assert torch.equal(p.page(b), truth[d]), f"step {step}: wrong bytes"
                served += ok
                failed_total += len(mine) - ok
        faults.on = False
        p.tiers.drain()
        assert p.tiers.slots.counts()["pinned"] == 0
        assert served > 0 and failed_total > 0
    finally:
        p.close()
