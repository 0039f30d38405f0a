"""The capacity x policy sweep: rows replayed in parallel processes next to two Belady bounds.

Each row (one device capacity, one policy) replays the whole trace through a fresh
:class:`SimCache`. Rows run in a process pool (``jobs`` workers, the trace handed to each worker
once); results come back in the sweep's own order, so a parallel run's numbers are the serial
run's exactly (every row is deterministic and shares nothing).

Two bounds per row, both Belady's MIN over the block access sequence:

- **effective**: at the most distinct blocks the configuration can hold (:func:`effective_blocks`);
  "of optimum" is the hit rate over this one: how far the policy is from the best that *this*
  tier layout could do.
- **total**: at device + host + storage blocks. No cache of that many blocks can hit more, so a
  row above it means the bound or the simulator is wrong, and the sweep raises.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import NamedTuple

from tqdm import tqdm

from tiered_kv.errors import TieredKVError
from tiered_kv.names import WritePolicy
from tiered_kv.sim.belady import access_sequence, belady_hits
from tiered_kv.sim.simulator import SimCache
from tiered_kv.sim.traces import TraceRequest, unique_blocks

_PROGRESS_EVERY = 200  # requests between a worker's progress reports


class BoundExceededError(TieredKVError):
    """A policy hit more blocks than Belady's MIN at the capacity its tiers add up to."""


class RowSpec(NamedTuple):
    capacity: float
    policy: str
    host_policy: str
    device_blocks: int
    host_blocks: int
    storage_blocks: int
    write_policy: str


def effective_blocks(device: int, host: int, storage: int, write_policy: str) -> int:
    """The most distinct blocks the tiers can hold at once under ``write_policy``.

    - ``write_through``: every block is copied down as it is inserted (device -> host, host ->
      storage), so each tier holds copies of the one above while it has room: the tiers are
      inclusive and hold ``max(device, host, storage)`` distinct blocks (a host smaller than the
      device adds nothing; a host twice the device holds the device's blocks and as many more).
    - ``write_through_selective``: only blocks hit ``selective_hits`` times are copied to the
      host, and the host's copies outlive their device copies; storage backs up the host. Device
      blocks without a copy and host (or storage) blocks add: ``device + max(host, storage)``
      (an upper estimate: a hot block held on both counts twice).
    - ``write_back``: a block reaches the host only when the device evicts it and storage only
      when the host does: the tiers add up, ``device + host + storage``.
    """
    if write_policy == WritePolicy.WRITE_THROUGH:
        return max(device, host, storage)
    if write_policy == WritePolicy.WRITE_THROUGH_SELECTIVE:
        return device + max(host, storage)
    return device + host + storage


def _blocks(value: float, unique: int) -> int:
    """A capacity (a fraction of the unique blocks, or a block count) in blocks, at most the
    unique blocks: a tier that holds every block never evicts, so more changes no hit, and a
    count like 1e18 would only make the tier's free list exhaust memory."""
    return min(max(1, unique), max(1, int(value) if value > 1 else int(round(value * unique))))


def row_specs(
    unique: int,
    capacities,
    policies,
    host_ratio: float,
    storage: float,
    write_policy: str,
    host_policy: str = "same",
) -> list[RowSpec]:
    storage_blocks = _blocks(storage, unique) if storage else 0
    specs = []
    for cap in capacities:
        device = _blocks(cap, unique)
        for policy in policies:
            hp = policy if host_policy == "same" else host_policy
            host = device * host_ratio  # a float: 1e300 x blocks may be inf
            host = unique if host >= unique else int(host)  # as _blocks: no more than it all
            specs.append(RowSpec(cap, policy, hp, device, host, storage_blocks, write_policy))
    return specs


# -- the work a process does (module globals: the pool's initializer sets them once) ------------
_trace: list[TraceRequest] = []
_accesses: list[int] = []
_counter = None  # a shared multiprocessing.Value of requests replayed, or None


def _init(trace, counter) -> None:
    global _trace, _accesses, _counter
    _trace, _accesses, _counter = trace, access_sequence(trace), counter


def _report(n: int) -> None:
    if _counter is not None:
        with _counter.get_lock():
            _counter.value += n


def _replay(spec: RowSpec) -> dict:
    t = time.perf_counter()
    sim = SimCache(
        spec.device_blocks,
        spec.host_blocks,
        spec.storage_blocks,
        device_policy=spec.policy,
        host_policy=spec.host_policy,
        write_policy=spec.write_policy,
    )
    done = 0
    for i, r in enumerate(_trace, 1):
        sim.request(r.blocks)
        if i % _PROGRESS_EVERY == 0:
            _report(i - done)
            done = i
    _report(len(_trace) - done)
    res = sim.result
    return {
        "capacity": spec.capacity,
        "device_blocks": spec.device_blocks,
        "host_blocks": spec.host_blocks,
        "storage_blocks": spec.storage_blocks,
        "policy": spec.policy,
        "host_policy": spec.host_policy,
        "hits": res.device + res.host + res.storage,
        "device_rate": res.rate("device"),
        "host_rate": res.rate("host"),
        "storage_rate": res.rate("storage"),
        "hit_rate": res.hit_rate,
        "seconds": time.perf_counter() - t,
    }


def _bound(capacity: int) -> int:
    return belady_hits(_accesses, capacity)


def _task(kind: str, arg):
    return _replay(arg) if kind == "row" else _bound(arg)


def _cost(task: tuple) -> int:
    kind, arg = task
    return arg.device_blocks + arg.host_blocks if kind == "row" else -1


def check_bounds(rows: list[dict]) -> None:
    """Raise :class:`BoundExceededError` naming the first row whose hits exceed Belady's at
    its total capacity (device + host + storage)."""
    for r in rows:
        if r["hits"] > r["total_hits"]:
            raise BoundExceededError(
                f"policy {r['policy']} at {r['total_blocks']} blocks (device "
                f"{r['device_blocks']} + host {r['host_blocks']} + storage "
                f"{r['storage_blocks']}) hit {r['hits']} blocks, above Belady's "
                f"{r['total_hits']}: the bound or the simulator is wrong"
            )


def sweep(
    trace,
    capacities,
    policies,
    host_ratio,
    storage,
    write_policy,
    progress=True,
    host_policy: str = "same",
    jobs: int | None = None,
) -> dict:
    """Every (capacity, policy) row with both bounds; ``jobs`` worker processes (None: one per
    CPU; 1: in this process). Raises :class:`BoundExceededError` if a row beats its total
    bound."""
    unique = unique_blocks(trace)
    accesses = len(access_sequence(trace))
    specs = row_specs(unique, capacities, policies, host_ratio, storage, write_policy, host_policy)

    def bound_caps(s: RowSpec) -> tuple[int, int]:
        eff = effective_blocks(s.device_blocks, s.host_blocks, s.storage_blocks, write_policy)
        return eff, s.device_blocks + s.host_blocks + s.storage_blocks

    caps = sorted({c for s in specs for c in bound_caps(s)})
    tasks = [("bound", c) for c in caps] + [("row", s) for s in specs]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(tasks)))
    bar = tqdm(
        total=len(specs) * len(trace),
        desc="replaying",
        unit="req",
        smoothing=0,  # the ETA from the whole run's mean rate: rows differ in speed
        disable=not progress,
    )
    results: list = [None] * len(tasks)
    rows_done = 0
    if jobs == 1:
        _init(trace, None)
        for i, (kind, arg) in enumerate(tasks):
            results[i] = _task(kind, arg)
            if kind == "row":
                rows_done += 1
                bar.update(len(trace))
                bar.set_postfix_str(f"rows {rows_done}/{len(specs)}")
    else:
        ctx = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
        counter = ctx.Value("q", 0)
        with ProcessPoolExecutor(jobs, ctx, initializer=_init, initargs=(trace, counter)) as pool:
            # Largest rows first (a bigger tree makes every eviction dearer), the short bounds
            # last: the workers then finish together instead of one running the last big row.
            first = sorted(range(len(tasks)), key=lambda i: -_cost(tasks[i]))
            pending = {pool.submit(_task, *tasks[i]): i for i in first}
            while pending:
                done, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                for f in done:
                    i = pending.pop(f)
                    results[i] = f.result()
                    rows_done += tasks[i][0] == "row"
                bar.update(counter.value - bar.n)
                bar.set_postfix_str(f"rows {rows_done}/{len(specs)}")
    bar.close()
    bounds = dict(zip(caps, results[: len(caps)], strict=True))
    rows = results[len(caps) :]
    for s, r in zip(specs, rows, strict=True):
        eff, total = bound_caps(s)
        r.update(
            effective_blocks=eff,
            effective_rate=bounds[eff] / accesses if accesses else 0.0,
            total_blocks=total,
            total_hits=bounds[total],
            total_rate=bounds[total] / accesses if accesses else 0.0,
        )
    check_bounds(rows)
    for r in rows:
        del r["total_hits"]
        r["of_optimum"] = r["hit_rate"] / r["effective_rate"] if r["effective_rate"] else None
    return {
        "unique_blocks": unique,
        "accesses": accesses,
        "requests": len(trace),
        "of_optimum_uses": "effective",
        "rows": rows,
    }
