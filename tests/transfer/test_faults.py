"""Randomised fault injection over both workers: ~200 seeded jobs (writes, loads, backups,
prefetches), every copy and store call failing with probability 0.2 (raising before or after
doing its work), interleaved with random polls and waits.

Every job gets exactly one result; an ok result means the destination holds exactly the source
bytes (host slots for writes and prefetches, device slots for loads, the pages read back from
the store for backups); the pages a storage job reports done are exact even when it failed.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import torch

from tests.transfer._util import (
    TIMEOUT,
    Results,
    assert_same_bits,
    device_kv,
    fresh_device,
    fresh_host,
    host_kv_all,
    keys_for,
    kv_rig,
    page_bytes,
    page_run,
    stored_bytes,
    token_bytes,
)
from tiered_kv.storage import MemoryStorage, StorageNamespace
from tiered_kv.transfer import DeviceHostTransfer, HostStorageTransfer, TransferJob

FAIL_P = 0.2
JOBS = 200


class _Faults:
    """Decides, per call, whether it fails and when (thread-safe; the copy and storage threads
    call it in their own order, so only the test's own choices replay exactly from the seed)."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.injected = 0

    def call(self, what: str, fn, *args, **kwargs):
        with self._lock:
            fail = self._rng.random() < FAIL_P
            before = self._rng.random() < 0.5
            self.injected += fail
        if fail and before:
            raise OSError(f"injected fault in {what} (before)")
        out = fn(*args, **kwargs)
        if fail:
            raise OSError(f"injected fault in {what} (after)")
        return out


class _FaultyStore:
    def __init__(self, inner, faults: _Faults) -> None:
        self.inner, self.faults = inner, faults

    def batch_exists(self, keys):
        return self.faults.call("batch_exists", self.inner.batch_exists, keys)

    def batch_get(self, keys, source, pages):
        return self.faults.call("batch_get", self.inner.batch_get, keys, source, pages)

    def batch_set(self, keys, source, pages):
        return self.faults.call("batch_set", self.inner.batch_set, keys, source, pages)


def _pages(slots: torch.Tensor) -> torch.Tensor:
    """Whole-page runs of freshly allocated slots, one page per row."""
    rows = slots.reshape(-1, 4)
    assert bool((rows - rows[:, :1] == torch.arange(4)).all()) and not bool((rows[:, 0] % 4).any())
    return rows


def _faulty_engine_jobs(host, faults: _Faults, monkeypatch) -> None:
    """Copy-engine jobs fail too: building one raises (before or after the work), or the
    engine refuses it (every layer of it, or one random layer)."""
    real = host.row_job

    def row_job(*args, **kwargs):
        job = faults.call("row_job", real, *args, **kwargs)
        if job is None:
            return None
        with faults._lock:
            refuse = faults._rng.random() < FAIL_P / 2
            one = faults._rng.randrange(len(job.layers))
            faults.injected += refuse
        if not refuse:
            return job
        if job.whole or faults._rng.random() < 0.5:
            return dataclasses.replace(job, threads=0)
        order = job.layers.tolist()
        order[one] = job.shape.total_layers  # that layer alone is refused
        return dataclasses.replace(job, shape=job.shape.with_layers(order))

    monkeypatch.setattr(host, "row_job", row_job)


def test_random_jobs_with_injected_faults(gen, monkeypatch, copier):
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    print(f"random seed of this test: {seed}")
    rng = random.Random(seed)
    faults = _Faults(seed + 1)
    pool, alloc, host = kv_rig(device_pages=32, host_pages=48)
    if copier == "engine":
        _faulty_engine_jobs(host, faults, monkeypatch)
    else:
        for name in ("load_to_device_per_layer", "backup_from_device_all_layer"):
            real = getattr(host, name)
            monkeypatch.setattr(
                host,
                name,
                lambda *a, _real=real, _name=name, **k: faults.call(_name, _real, *a, **k),
            )
    inner = MemoryStorage(
        StorageNamespace.for_host_pool(host, model="test-model"), host.page_nbytes
    )
    dh = DeviceHostTransfer(alloc, host, layer_slots=rng.choice([1, 2, 3]))
    hs = HostStorageTransfer(host, _FaultyStore(inner, faults), batch_pages=rng.choice([1, 2, 3]))
    dev_rows = _pages(alloc.alloc(alloc.available_size()))
    host_rows = _pages(host.alloc(host.available_size()))
    tb, pb = token_bytes(pool), host.page_nbytes
    res = {"dh": Results(dh), "hs": Results(hs)}
    known: dict[bytes, torch.Tensor] = {}  # every key ever backed up -> its page's bytes
    outcomes = {"ok": 0, "failed": 0}
    next_id = 0
    deadline = time.monotonic() + 45
    try:
        while next_id < JOBS:
            assert time.monotonic() < deadline, f"too slow (seed {seed})"
            free_dev = rng.sample(range(len(dev_rows)), len(dev_rows))
            free_host = rng.sample(range(len(host_rows)), len(host_rows))
            checks = []  # (worker name, job, check(result), destination description)
            known_now = list(known)
            for _ in range(min(rng.randint(3, 10), JOBS - next_id)):
                job_id, where = next_id, f"job {next_id} (seed {seed})"
                next_id += 1
                kind = rng.choice(["write", "load", "backup", "prefetch"])
                if kind == "prefetch" and not known_now:
                    kind = "backup"
                if kind in ("write", "load"):
                    m = rng.randint(1, 3)
                    d_all = dev_rows[[free_dev.pop() for _ in range(m)]].reshape(-1)
                    h_all = host_rows[[free_host.pop() for _ in range(m)]].reshape(-1)
                    n = rng.randint(1, m * 4)
                    d = d_all[torch.tensor(rng.sample(range(len(d_all)), n))]
                    h = h_all[torch.tensor(rng.sample(range(len(h_all)), n))]
                    if kind == "write":
                        k, v = fresh_device(pool, d, gen)
                        job = TransferJob.write(job_id, d, h)

                        def check(r, h=h, k=k, v=v, n=n, where=where):
                            if r.ok:
                                assert r.nbytes == n * tb, where
                                gk, gv = host_kv_all(host, h)
                                assert_same_bits(gk, k, f"{where}: written K")
                                assert_same_bits(gv, v, f"{where}: written V")
                            else:
                                assert r.nbytes == 0, where

                    else:
                        k, v = fresh_host(host, h, gen)
                        job = TransferJob.load(job_id, h, d)

                        def check(r, d=d, k=k, v=v, n=n, where=where):
                            if r.ok:
                                assert r.nbytes == n * tb, where
                                gk, gv = device_kv(pool, d)
                                assert_same_bits(gk, k, f"{where}: loaded K")
                                assert_same_bits(gv, v, f"{where}: loaded V")
                            else:
                                assert r.nbytes == 0, where

                    worker = "dh"
                elif kind == "backup":
                    m = rng.randint(1, 4)
                    pages = host_rows[[free_host.pop() for _ in range(m)]][:, 0] // 4
                    slots = page_run(pages)
                    fresh_host(host, slots, gen)
                    src = page_bytes(host, pages.tolist())
                    keys = keys_for(host, m, gen)
                    known.update(zip(keys, src, strict=True))
                    job = TransferJob.backup(job_id, keys, slots)

                    def check(r, keys=keys, src=src, m=m, where=where):
                        # MemoryStorage stores every page it is given: failed == an error.
                        assert r.ok == (r.error is None), where
                        assert r.nbytes == r.pages_done * pb and r.num_pages == m, where
                        if r.ok:
                            assert r.pages_done == m, where
                        got = stored_bytes(inner, keys[: r.pages_done], pb)
                        assert got is not None, f"{where}: pages reported done are not stored"
                        for i, (a, b) in enumerate(zip(got, src, strict=False)):
                            assert torch.equal(a, b), f"{where}: stored page {i} differs"

                    worker = "hs"
                else:
                    m = rng.randint(1, 4)
                    keys = [rng.choice(known_now) for _ in range(m)]
                    if rng.random() < 0.15:
                        keys[rng.randrange(m)] = keys_for(host, 1, gen)[0]  # never stored
                    pages = host_rows[[free_host.pop() for _ in range(m)]][:, 0] // 4
                    slots = page_run(pages)
                    fresh_host(host, slots, gen)
                    before = page_bytes(host, pages.tolist())
                    job = TransferJob.prefetch(job_id, keys, slots)

                    def check(r, keys=keys, pages=pages, before=before, m=m, where=where):
                        got = page_bytes(host, pages.tolist())
                        assert r.nbytes == r.pages_done * pb and r.num_pages == m, where
                        assert r.ok == (r.pages_done == m and r.error is None), where
                        for i in range(r.pages_done):
                            assert torch.equal(got[i], known[keys[i]]), f"{where}: page {i}"
                        if r.error is None and not r.ok:
                            # Stopped at a page the store does not hold, touching none after.
                            assert inner.batch_exists([keys[r.pages_done]]) == 0, where
                            for i in range(r.pages_done, m):
                                assert torch.equal(got[i], before[i]), f"{where}: page {i}"

                    worker = "hs"
                assert res[worker].submit(job), f"{where} refused"
                checks.append((worker, job, check))
                # Interleave: poll, wait for some jobs, or a timed wait on the storage worker.
                x = rng.random()
                if x < 0.3:
                    res[rng.choice(["dh", "hs"])].poll()
                elif x < 0.4:
                    r = res[rng.choice(["dh", "hs"])]
                    pending = sorted(r.submitted - r.by_id.keys())
                    if pending:
                        ids = rng.sample(pending, rng.randint(1, len(pending)))
                        assert r.worker.wait(ids, TIMEOUT), f"wait({ids}) (seed {seed})"
                        r.poll()
                        assert set(ids) <= r.by_id.keys(), f"waited, not delivered (seed {seed})"
                elif x < 0.45:
                    hs.wait(None, rng.choice([0.0, 0.001]))
            for r in res.values():
                r.drain()
            for worker, job, check in checks:
                result = res[worker].by_id[job.job_id]
                assert result.direction is job.direction
                check(result)
                outcomes["ok" if result.ok else "failed"] += 1
        for r in res.values():
            assert r.submitted == r.by_id.keys() and len(r.order) == len(r.submitted)
            assert r.worker.poll() == [] and r.worker.in_flight == 0
        assert sum(len(r.order) for r in res.values()) == JOBS
        assert outcomes["ok"] > 0 and outcomes["failed"] > 0 and faults.injected > 0, outcomes
        # The device <-> host stats count each job once, failed ones as failed.
        dh_results = list(res["dh"].by_id.values())
        stats = dh.stats.snapshot()
        for direction in dh.directions:
            mine = [r for r in dh_results if r.direction is direction]
            s = stats[direction.value]
            assert s.ops == len(mine) and s.failed_ops == sum(not r.ok for r in mine)
            assert s.bytes == sum(r.nbytes for r in mine)
    finally:
        dh.close()
        hs.close()
