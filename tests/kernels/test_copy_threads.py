"""How many threads a copy takes: asynchronous copies only the cores the compute threads leave
free, synchronous ones the compute threads' cores; ``TIERED_KV_COPY_THREADS`` overrides both."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tiered_kv import InvalidArgumentError
from tiered_kv.kernels import row_job
from tiered_kv.kernels.row_job import (
    COPY_THREADS_ENV,
    HELPERS_MIN_BYTES,
    copy_threads,
    engine_threads,
    free_cores,
    run_beside_compute,
    sync_threads,
)

BIG = HELPERS_MIN_BYTES
SMALL = HELPERS_MIN_BYTES - 1


@pytest.fixture
def machine(monkeypatch):
    """Set (usable cores, torch threads) for the rules, env unset."""
    monkeypatch.delenv(COPY_THREADS_ENV, raising=False)

    def set_(cores: int, compute: int) -> None:
        monkeypatch.setattr(row_job.os, "sched_getaffinity", lambda _pid: set(range(cores)))
        monkeypatch.setattr(row_job.torch, "get_num_threads", lambda: compute)

    return set_


@pytest.mark.parametrize(
    "cores, compute, free, async_threads, sync",
    [
        (2, 2, 0, 1, 2),  # every core computes: the copier alone beside it
        (2, 1, 1, 1, 1),  # vLLM CPU with one core reserved
        (16, 16, 0, 1, 16),  # the old rule gave 15 helpers here, all on compute cores
        (16, 4, 12, 12, 4),
        (1, 1, 0, 1, 1),
        (3, 8, 0, 1, 8),  # more compute threads than cores (an affinity mask)
    ],
)
def test_threads_follow_the_free_cores(machine, cores, compute, free, async_threads, sync):
    machine(cores, compute)
    assert free_cores() == free
    assert engine_threads(BIG) == async_threads
    assert sync_threads(BIG) == sync
    assert engine_threads(SMALL) == sync_threads(SMALL) == 1  # small: no thread to wake


def test_the_setting_overrides_both(machine, monkeypatch):
    machine(16, 16)
    monkeypatch.setenv(COPY_THREADS_ENV, "3")
    assert engine_threads(BIG) == sync_threads(BIG) == 3
    assert engine_threads(SMALL) == 1
    monkeypatch.setenv(COPY_THREADS_ENV, " ")
    assert engine_threads(BIG) == 1


@pytest.mark.parametrize("bad", ["0", "-2", "65", "two", "1.5"])
def test_a_bad_setting_is_refused_naming_it(machine, monkeypatch, bad):
    machine(4, 2)
    monkeypatch.setenv(COPY_THREADS_ENV, bad)
    with pytest.raises(InvalidArgumentError, match=f"{COPY_THREADS_ENV}='{bad}'.*1..64"):
        engine_threads(BIG)


def test_a_bad_setting_is_refused_when_the_transfer_worker_is_built(monkeypatch):
    from tiered_kv.device import MHATokenToKVPool, PagedTokenToKVPoolAllocator
    from tiered_kv.host import host_pool_for
    from tiered_kv.transfer import DeviceHostTransfer

    pool = MHATokenToKVPool(64, 16, torch.float16, 2, 8, 2, "cpu")
    alloc = PagedTokenToKVPoolAllocator(64, 16, torch.float16, "cpu", kvcache=pool)
    host = host_pool_for(pool.host_pool_decls()[0], alloc, size_tokens=64, reserve_bytes=0)
    monkeypatch.setenv(COPY_THREADS_ENV, "lots")
    with pytest.raises(InvalidArgumentError, match=COPY_THREADS_ENV):
        DeviceHostTransfer(alloc, host)
    monkeypatch.setenv(COPY_THREADS_ENV, "2")
    DeviceHostTransfer(alloc, host).close()


def test_only_marked_threads_copy_beside_compute(machine):
    machine(16, 4)
    assert copy_threads(BIG) == 4  # this thread: synchronous
    with ThreadPoolExecutor(1, initializer=run_beside_compute) as pool:
        assert pool.submit(copy_threads, BIG).result() == 12
    got = []
    t = threading.Thread(target=lambda: got.append(copy_threads(BIG)))
    t.start()
    t.join()
    assert got == [4]  # the mark is per thread
