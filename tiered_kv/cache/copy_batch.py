"""CopyBatch: several nodes' copies of one direction as one job.

While a batch is open, the manager sets each copy up as usual (slots, pending marks, locks)
but hands its job here instead of to the worker; ``flush`` submits all of them as one job of
the same direction, indices (and storage keys) concatenated in the order they came.

- Host -> device loads of requests begun together: one plan, one layer-done slot, each layer
  published once every request's part of it has landed, so the batch's forward waits on one
  event per layer (SGLang's controller merges its queued loads the same way before a forward).
- Device -> host writes of the requests finished together: one copy of every layer.
- Host -> storage backups acknowledged in one poll: one store transaction per ``batch_pages``
  pages instead of one (and its fixed cost) per node.
- Storage -> host prefetches of requests begun together: one job of one segment per request
  (``TransferJob.segments``), so each request's chain stops at its own first missing page and
  its part gets its own leading pages (``TransferResult.segment_pages``).

The merged job has its own id; its result is handed to each part's own job, so every part keeps
its handler, locks and pending marks, and all parts share one fate: a merged job that fails or
is refused fails every part (a load's part marks its copies stale, a write's frees its host
copy, a backup's node is simply not marked stored). ``worker_id`` maps a part to the id the
worker knows, for whoever must wait on it or find its layer-done slot.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tiered_kv.cache.jobs import Job, JobTable
from tiered_kv.errors import StateError
from tiered_kv.names import Direction, JobId, PendingKind
from tiered_kv.transfer.base import TransferJob, TransferResult

_KINDS = {
    Direction.HOST_TO_DEVICE: PendingKind.LOAD,
    Direction.DEVICE_TO_HOST: PendingKind.WRITE,
    Direction.HOST_TO_STORAGE: PendingKind.BACKUP,
    Direction.STORAGE_TO_HOST: Direction.STORAGE_TO_HOST,  # the prefetcher's jobs' kind
}


def _merge(job_id: JobId, direction: Direction, parts: list[TransferJob]) -> TransferJob:
    host = torch.cat([p.host_indices for p in parts])
    keys = [k for p in parts for k in p.keys]
    if direction is Direction.HOST_TO_STORAGE:
        return TransferJob.backup(job_id, keys, host)
    if direction is Direction.STORAGE_TO_HOST:
        return TransferJob.prefetch(job_id, keys, host, [p.num_pages for p in parts])
    device = torch.cat([p.device_indices for p in parts])
    if direction is Direction.HOST_TO_DEVICE:
        return TransferJob.load(job_id, host, device)
    return TransferJob.write(job_id, device, host)


class CopyBatch:
    def __init__(
        self, jobs: JobTable, direction: Direction, submit: Callable[[TransferJob], bool]
    ) -> None:
        if direction not in _KINDS:
            raise StateError(f"direction={direction!r} is not batched; batched: {list(_KINDS)}")
        self._jobs = jobs
        self.direction = direction
        self._submit = submit  # the manager's: a refusal or a raise fails the job first
        self._open = False
        self._parts: list[TransferJob] = []
        self._merged_into: dict[JobId, JobId] = {}  # part -> merged job, while it is in flight
        # merged -> (part, slots, pages) of each part
        self._members: dict[JobId, list[tuple[JobId, int, int]]] = {}

    @property
    def is_open(self) -> bool:
        return self._open

    def open(self) -> None:
        if self._open:
            raise StateError(f"a {self.direction} batch is already open; flush it first")
        self._open = True

    def add(self, job: TransferJob) -> None:
        """Hold ``job`` (of this batch's direction) until ``flush``."""
        if not self._open:
            raise StateError(f"no {self.direction} batch is open")
        if job.direction is not self.direction:
            raise StateError(f"a {job.direction} job cannot join a {self.direction} batch")
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
        merged = self._jobs.new(_KINDS[self.direction], None, self._fan_out)
        self._members[merged] = [(p.job_id, len(p.host_indices), p.num_pages) for p in parts]
        for p in parts:
            self._merged_into[p.job_id] = merged
        return self._submit(_merge(merged, self.direction, parts))

    def _fan_out(self, _job: Job, result: TransferResult) -> None:
        members = self._members.pop(result.job_id)
        total = sum(n for _, n, _ in members) or 1
        done = _pages_done(result, [pages for _, _, pages in members])
        for i, (part, size, pages) in enumerate(members):
            del self._merged_into[part]
            ok, got, nbytes = result.ok, pages if result.ok else 0, result.nbytes * size // total
            if done is not None:  # a prefetch: each part has its own leading pages
                got = done[i]
                ok, nbytes = got == pages, _share(result, got)
            self._jobs.deliver(
                TransferResult(
                    part,
                    result.direction,
                    ok,
                    nbytes,
                    result.seconds,
                    got,
                    pages,
                    None,  # the merged job's own delivery counted its error, once
                )
            )


def _pages_done(result: TransferResult, pages: list[int]) -> list[int] | None:
    """A merged prefetch's leading pages per part: the worker's per-segment counts, or, from a
    worker that read the keys as one chain, its leading pages shared out in order. None for
    the other directions (a part's pages are all done or none)."""
    if result.direction is not Direction.STORAGE_TO_HOST:
        return None
    if len(result.segment_pages) == len(pages):
        return list(result.segment_pages)
    left, out = result.pages_done, []
    for n in pages:
        out.append(min(n, left))
        left -= out[-1]
    return out


def _share(result: TransferResult, pages: int) -> int:
    return result.nbytes * pages // result.pages_done if result.pages_done else 0
