"""The Prometheus metrics ``tiered-kv run`` exports, one collector for its endpoint
(``--metrics-port``) and its final file (``--metrics-file``).

Every series carries a ``mode`` label (``tiered``, ``device_only``, ...): each mode serves with a
cache of its own, whose counters start at 0, so without the label the modes' counters would mix
and seem to restart. The mode serving now is read live from its cache's registry; a mode that
has ended is served as its cache's series were when it closed (a copy: the cache itself is let
go, as its pools must be before the next mode allocates its own).

Per mode, from its report (the same numbers as ``--json``): ``run_hit_ratio{tier}``, the
prompt tokens served from each tier over all prompt tokens (the computed ones are the rest),
and ``run_modeled_ttft_seconds{quantile}``, the modeled time to first token's p50 and p99
(quantiles of the mode's requests, like a summary's; no buckets, as every request's TTFT is
known at the end). ``run_mode_finished`` is 0 while a mode serves and 1 once it has ended;
``run_finished`` is 1 once the whole run has (its values are final then).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

HIT_TIERS = ("device", "host", "storage")
QUANTILES = (("0.5", "ttft_p50_s"), ("0.99", "ttft_p99_s"))


def with_mode(families: Iterable[Metric], mode: str) -> list[Metric]:
    """Copies of ``families`` whose every sample has the label ``mode``."""
    out = []
    for family in families:
        copy = Metric(family.name, family.documentation, family.type, family.unit)
        copy.samples = [s._replace(labels={"mode": mode, **s.labels}) for s in family.samples]
        out.append(copy)
    return out


def merged(families: Iterable[Metric]) -> list[Metric]:
    """One family per name, its samples in the order they came (the text format wants a
    family's samples together, under one HELP and TYPE)."""
    by_name: dict[str, Metric] = {}
    for family in families:
        kept = by_name.get(family.name)
        if kept is None:
            kept = by_name[family.name] = Metric(
                family.name, family.documentation, family.type, family.unit
            )
        kept.samples.extend(family.samples)
    return list(by_name.values())


class RunMetrics(Collector):
    """Every mode's series under its ``mode`` label (see the module doc). The hooks
    (``on_cache``, ``on_mode_done``, ``finish``) are called from the serving thread; ``collect``
    from any (the endpoint's)."""

    def __init__(self, prefix: str = "tiered_kv") -> None:
        self.prefix = prefix
        self._lock = threading.Lock()  # the hooks' state against a scrape reading it
        self._live: tuple[str, CollectorRegistry] | None = None
        self._ended: dict[str, list[Metric]] = {}  # mode -> its series when its cache closed
        self._reports: dict[str, dict] = {}
        self._finished = False

    def on_cache(self, mode: str, cache) -> None:
        """``mode``'s cache is about to serve: its registry is read live from now on."""
        with self._lock:
            self._live = (mode, cache.registry)

    def on_mode_done(self, mode: str, report: dict) -> None:
        """``mode`` ended with ``report`` (its cache closed): copy its series, let go of its
        cache."""
        with self._lock:
            live, self._live = self._live, None
        series = with_mode(live[1].collect(), mode) if live and live[0] == mode else []
        with self._lock:
            self._ended[mode] = series
            self._reports[mode] = report

    def finish(self) -> None:
        """Every mode has ended: the values are final."""
        with self._lock:
            self._finished = True

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            live, ended = self._live, dict(self._ended)
            reports, finished = dict(self._reports), self._finished
        families = [f for series in ended.values() for f in series]
        if live is not None:
            families += with_mode(live[1].collect(), live[0])
        yield from merged(families)
        yield from self._summary(live, reports, finished)

    def _summary(self, live, reports: dict[str, dict], finished: bool) -> Iterator[Metric]:
        p = self.prefix
        state = GaugeMetricFamily(
            f"{p}_run_mode_finished",
            "0 while the mode serves, 1 once it has ended (its series are final then).",
            labels=["mode"],
        )
        for mode in reports:
            state.add_metric([mode], 1)
        if live is not None and live[0] not in reports:
            state.add_metric([live[0]], 0)
        yield state
        yield GaugeMetricFamily(
            f"{p}_run_finished", "1 once every mode of the run has ended.", value=int(finished)
        )
        ratio = GaugeMetricFamily(
            f"{p}_run_hit_ratio",
            "Prompt tokens whose KV came from the tier over all prompt tokens, per ended mode.",
            labels=["mode", "tier"],
        )
        ttft = GaugeMetricFamily(
            f"{p}_run_modeled_ttft_seconds",
            "Modeled time to first token of the mode's requests at a quantile, per ended mode.",
            labels=["mode", "quantile"],
        )
        for mode, r in reports.items():
            prompt = r["prompt_tokens"]
            for tier in HIT_TIERS:
                ratio.add_metric([mode, tier], r["hits"][tier] / prompt if prompt else 0.0)
            for q, key in QUANTILES:
                if r["modeled"][key] is not None:
                    ttft.add_metric([mode, q], r["modeled"][key])
        yield ratio
        yield ttft
