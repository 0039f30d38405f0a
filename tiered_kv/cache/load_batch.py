"""LoadBatch: several requests' host -> device loads as one layer-wise job.

While a batch is open, ``CacheManager.load_back`` sets each chain up as usual (device slots,
pending marks, locks) but hands its load job here instead of to the worker; ``flush`` submits
all of them as one job, host and device indices concatenated in the order they came: one plan,
one layer-done slot, each layer published once every request's part of it has landed, so the
batch's forward waits on one event per layer (SGLang's controller merges its queued loads the
same way before a forward).

The merged job has its own id; its result is handed to each part's own job, so every part keeps
its handler, locks and pending marks, and all parts share one fate: a merged job that fails or
is refused fails every part (each part's handler marks its copies stale). ``worker_id`` maps a
part to the id the worker knows, for whoever must wait on it or find its layer-done slot.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tiered_kv.cache.jobs import Job, JobTable
from tiered_kv.errors import StateError
from tiered_kv.names import JobId, PendingKind
from tiered_kv.transfer.base import TransferJob, TransferResult


class LoadBatch:
    def __init__(self, jobs: JobTable, submit: Callable[[TransferJob], bool]) -> None:
        self._jobs = jobs
        self._submit = submit  # the manager's: a refusal or a raise fails the job first
        self._open = False
        self._parts: list[TransferJob] = []
        self._merged_into: dict[JobId, JobId] = {}  # part -> merged job, while it is in flight
        self._members: dict[JobId, list[tuple[JobId, int]]] = {}  # merged -> (part, tokens)

    @property
    def is_open(self) -> bool:
        return self._open

    def open(self) -> None:
        if self._open:
            raise StateError("a load batch is already open; flush it first")
        self._open = True

    def add(self, job: TransferJob) -> None:
        """Hold ``job`` (a load) until ``flush``."""
        if not self._open:
            raise StateError("no load batch is open")
        self._parts.append(job)

    def holds(self, job_id: JobId) -> bool:
        """Whether ``job_id`` is a part not submitted yet (it goes with the next flush)."""
        return any(p.job_id == job_id for p in self._parts)

    def worker_id(self, job_id: JobId) -> JobId:
        """The id the worker knows part ``job_id`` by (its own when it was not merged)."""
        return self._merged_into.get(job_id, job_id)

    def flush(self) -> bool:
        """Close the batch and submit what it holds as one job. Returns False when the worker
        refused it (every part has failed then); True when submitted or empty."""
        parts, self._parts, self._open = self._parts, [], False
        if not parts:
            return True
        if len(parts) == 1:
            return self._submit(parts[0])
        merged = self._jobs.new(PendingKind.LOAD, None, self._fan_out)
        self._members[merged] = [(p.job_id, len(p.device_indices)) for p in parts]
        for p in parts:
            self._merged_into[p.job_id] = merged
        job = TransferJob.load(
            merged,
            torch.cat([p.host_indices for p in parts]),
            torch.cat([p.device_indices for p in parts]),
        )
        return self._submit(job)

    def _fan_out(self, _job: Job, result: TransferResult) -> None:
        members = self._members.pop(result.job_id)
        total = sum(n for _, n in members) or 1
        for part, tokens in members:
            del self._merged_into[part]
            self._jobs.deliver(
                TransferResult(
                    part,
                    result.direction,
                    result.ok,
                    result.nbytes * tokens // total,
                    result.seconds,
                    error=result.error,
                )
            )
