"""TransferMetrics: every transfer job's latency and size, per direction, as Prometheus
histograms on the cache's registry, and a warning for a slow one.

The job table hands over each result a worker reports (and each job a worker refused), once
per job: a batch of several requests' copies is one job here, as it is one copy on the
worker, so nothing is counted per token or per page. A job that did not land whole is counted
in ``failed_jobs`` instead of the histograms (its seconds and bytes are not a transfer's).

A job slower than ``slow_s`` (``SLOW_TRANSFER_S`` unless set on the instance) is a WARNING on
this module's logger, at most one per direction a minute (a slow disk makes every job slow).
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Histogram

from tiered_kv.log_limit import LogLimiter
from tiered_kv.names import Direction
from tiered_kv.transfer.base import TransferResult

log = logging.getLogger(__name__)

# The one place the slow-transfer threshold is set: seconds of one job, any direction.
SLOW_TRANSFER_S = 1.0
# 100 us (a small device <-> host copy) to a minute (a large storage job on a busy disk).
SECONDS_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
# 4 KiB (one small page) to 64 GiB, by powers of 4.
BYTES_BUCKETS = tuple(float(4096 * 4**k) for k in range(13))


class TransferMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        prefix: str = "tiered_kv",
        slow_s: float | None = None,
    ) -> None:
        self.slow_s = SLOW_TRANSFER_S if slow_s is None else slow_s  # read when a cache is built
        labels = ("direction",)
        seconds = Histogram(
            f"{prefix}_transfer_job_seconds",
            "Seconds one transfer job's copy ran (jobs that landed whole), by direction.",
            labels,
            registry=registry,
            buckets=SECONDS_BUCKETS,
        )
        nbytes = Histogram(
            f"{prefix}_transfer_job_bytes",
            "Bytes one transfer job moved (jobs that landed whole), by direction.",
            labels,
            registry=registry,
            buckets=BYTES_BUCKETS,
        )
        failed = Counter(
            f"{prefix}_transfer_failed_jobs",
            "Transfer jobs that failed, were refused or landed only in part, by direction.",
            labels,
            registry=registry,
        )
        # Every direction's series exists from the start (at 0), so a dashboard's sum and rate
        # never miss a direction that has not moved anything yet.
        self._by = {
            d: (seconds.labels(d.value), nbytes.labels(d.value), failed.labels(d.value))
            for d in Direction
        }
        self._slow = LogLimiter(log)

    def observe(self, result: TransferResult) -> None:
        """Count one job's result (called once per job, in the serving thread's poll)."""
        seconds, nbytes, failed = self._by[result.direction]
        if result.ok:
            seconds.observe(result.seconds)
            nbytes.observe(result.nbytes)
        else:
            failed.inc()
        if result.seconds > self.slow_s:
            self._slow.log(
                logging.WARNING,
                str(result.direction),
                "slow %s transfer job: %.3f s for %d bytes (%d pages; threshold %.3g s)",
                str(result.direction),
                result.seconds,
                result.nbytes,
                result.num_pages,
                self.slow_s,
            )
