"""The copy engine under random load: ~150 seeded jobs (layer-wise loads, whole writes, jobs run
on the caller) submitted from two threads, waited on in random order or not at all, a fifth
of them refused by the engine (every layer, or one random layer). Every job that reports done
holds exactly its source bytes; every refused layer fails and leaves its destination as it was;
nothing is copied twice or lost when the engine closes with jobs queued."""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import pytest
import torch

from tests.host._util import fill_bits, fill_device, make_host, make_pool, part_columns
from tiered_kv.errors import TransferError
from tiered_kv.kernels import copy_engine
from tiered_kv.kernels.copy_engine import CopyEngine

pytestmark = pytest.mark.skipif(not copy_engine.available(), reason="no C compiler here")

JOBS = 150
TOKENS = 6  # per job: destinations never overlap, so every job's bytes can be checked at the end


def _records(pool, host, h):
    """Host records (L, n, E) as integers, per part like the device rows."""
    from tests.host._util import host_snapshot

    snap = host_snapshot(host)
    return {name: snap[:, h, a:b] for name, (a, b) in part_columns(pool).items()}


def _rows(pool, d):
    from tests.host._util import device_snapshot

    return {name: t[:, d] for name, t in device_snapshot(pool).items()}


def test_random_jobs_from_two_threads(gen):
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    rng = random.Random(seed)
    pool, alloc = make_pool("mha_v", 1, torch.bfloat16, pages=2 * JOBS * TOKENS + 8)
    host = make_host(pool, alloc, "page_first", host_pages=2 * JOBS * TOKENS + 8,
                     kernel_backend="native")  # fmt: skip
    fill_device(pool, gen)
    fill_bits(host.buffer, gen)
    dev = alloc.alloc(2 * JOBS * TOKENS)
    hst = host.alloc(2 * JOBS * TOKENS)
    dev = dev[torch.randperm(len(dev), generator=gen)]
    hst = hst[torch.randperm(len(hst), generator=gen)]
    # Loads read host slots hst[:half] into device slots dev[:half]; writes read dev[half:]
    # into hst[half:]: no job's source is another job's destination.
    half = JOBS * TOKENS
    before_dev = _rows(pool, dev[:half])
    before_host = _records(pool, host, hst[half:])
    want_dev = _records(pool, host, hst[:half])  # what loads must land
    want_host = _rows(pool, dev[half:])  # what writes must land
    engine = CopyEngine("stress", spin_us=rng.choice([0.0, 20.0, 200.0]))
    plans = []  # (kind, job index, refused layers or "all", events or None)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def submit(i: int, local: random.Random) -> None:
        load = local.random() < 0.5
        sl = slice(i * TOKENS, (i + 1) * TOKENS)
        h, d = (hst[:half][sl], dev[:half][sl]) if load else (hst[half:][sl], dev[half:][sl])
        job = host.row_job(pool, h, d, to_host=not load)
        refused: object = ()
        roll = local.random()
        if roll < 0.1:
            job, refused = dataclasses.replace(job, threads=0), "all"
        elif roll < 0.2 and load:
            bad = local.randrange(pool.layer_num)
            order = list(range(pool.layer_num))
            order[bad] = pool.layer_num + 1
            job, refused = dataclasses.replace(job, shape=job.shape.with_layers(order)), (bad,)
        if local.random() < 0.2:  # on the calling thread, now
            try:
                engine.run(dataclasses.replace(job, whole=True))
                outcome = "ok"
            except TransferError:
                outcome = "refused"
            with lock:
                plans.append(("load" if load else "write", i, refused, outcome))
            return
        events = engine.submit(job)
        if local.random() < 0.5:  # wait now, in a random order (the waiter helps)
            for e in local.sample(events, len(events)):
                try:
                    e.synchronize()
                except TransferError:
                    pass
        with lock:
            plans.append(("load" if load else "write", i, refused, events))

    def worker(ids: list[int], s: int) -> None:
        local = random.Random(s)
        try:
            for i in ids:
                submit(i, local)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    ids = list(range(JOBS))
    rng.shuffle(ids)
    threads = [threading.Thread(target=worker, args=(ids[k::2], seed + k)) for k in range(2)]
    deadline = time.monotonic() + 60
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, deadline - time.monotonic()))
        assert not t.is_alive(), f"stress threads stuck (seed {seed})"
    assert not errors, f"{errors[0]!r} (seed {seed})"
    engine.close()  # drains what nobody waited for
    assert len(plans) == JOBS

    got_dev, got_host = _rows(pool, dev[:half]), _records(pool, host, hst[half:])
    checked = 0
    for kind, i, refused, events in plans:
        sl = slice(i * TOKENS, (i + 1) * TOKENS)
        if isinstance(events, str):  # ran on the caller as a whole job: all or nothing
            assert (events == "refused") == bool(refused), (kind, i, refused, seed)
            failed = set(range(pool.layer_num)) if refused else set()
        else:
            states = []
            for e in events:
                assert e.query(), f"job {i} not done after close (seed {seed})"
                try:
                    e.synchronize()
                    states.append(True)
                except TransferError:
                    states.append(False)
            if refused == "all":
                assert not any(states), (i, seed)
                failed = set(range(pool.layer_num))
            elif refused:
                assert [not s for s in states] == [k in refused for k in range(len(states))], (
                    i,
                    seed,
                )
                failed = set(refused)
            else:
                assert all(states), (i, seed)
                failed = set()
        got, want, before = (
            (got_dev, want_dev, before_dev)
            if kind == "load"
            else (got_host, want_host, before_host)
        )
        for name in got:
            for layer in range(pool.layer_num):
                exp = before if layer in failed else want
                if not torch.equal(got[name][layer, sl], exp[name][layer, sl]):
                    raise AssertionError(
                        f"{kind} job {i} part {name} layer {layer}: wrong bytes (seed {seed})"
                    )
        checked += 1
    assert checked == JOBS
