"""``RunMetrics``: each mode's series under its ``mode`` label, one family per name across the
modes, an ended mode's values kept after its registry (and so its cache) is let go, the hit
ratios and TTFT quantiles from its report, and the run's end."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tiered_kv.cli.run_metrics import RunMetrics


def exposition(metrics: RunMetrics) -> tuple[str, dict[str, dict[tuple, float]]]:
    registry = CollectorRegistry()
    registry.register(metrics)
    text = generate_latest(registry).decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return text, out


def a_cache() -> tuple[SimpleNamespace, Counter, Histogram]:
    registry = CollectorRegistry()
    events = Counter("x_events", "Events.", ["kind"], registry=registry)
    seconds = Histogram("x_seconds", "Seconds.", registry=registry, buckets=(1.0,))
    return SimpleNamespace(registry=registry), events, seconds


def report(prompt: int, device: int, host: int, storage: int, p50: float, p99: float) -> dict:
    return {
        "prompt_tokens": prompt,
        "hits": {"device": device, "host": host, "storage": storage},
        "modeled": {"ttft_p50_s": p50, "ttft_p99_s": p99},
    }


def test_modes_are_labelled_kept_and_never_mixed():
    metrics = RunMetrics(prefix="x")
    first, events, seconds = a_cache()
    metrics.on_cache("tiered", first)
    events.labels("a").inc(3)
    seconds.observe(0.5)
    _, got = exposition(metrics)
    assert got["x_events_total"] == {(("kind", "a"), ("mode", "tiered")): 3.0}
    assert got["x_run_mode_finished"] == {(("mode", "tiered"),): 0.0}
    assert got["x_run_finished"] == {(): 0.0}
    assert "x_run_hit_ratio" not in got and "x_run_modeled_ttft_seconds" not in got  # none ended
    metrics.on_mode_done("tiered", report(10, 5, 2, 1, 0.1, 0.3))
    gone = weakref.ref(first.registry)
    del first, events, seconds
    gc.collect()
    assert gone() is None  # the ended mode's registry (a cache's: its pools) is let go

    second, events, _ = a_cache()
    metrics.on_cache("device_only", second)
    events.labels("a").inc(1)  # starts at 0 in its own cache
    text, got = exposition(metrics)
    assert got["x_events_total"] == {
        (("kind", "a"), ("mode", "tiered")): 3.0,  # kept as it ended
        (("kind", "a"), ("mode", "device_only")): 1.0,
    }
    assert text.count("# TYPE x_events_total counter") == 1  # one family, both modes
    assert got["x_seconds_count"] == {(("mode", "tiered"),): 1.0, (("mode", "device_only"),): 0}
    buckets = got["x_seconds_bucket"]
    assert buckets[(("le", "1.0"), ("mode", "tiered"))] == 1.0
    assert got["x_run_mode_finished"] == {(("mode", "tiered"),): 1.0, (("mode", "device_only"),): 0}
    events.labels("a").inc(1)  # the serving mode is read live
    assert exposition(metrics)[1]["x_events_total"][(("kind", "a"), ("mode", "device_only"))] == 2

    metrics.on_mode_done("device_only", report(8, 0, 0, 0, 0.2, None))
    metrics.finish()
    _, got = exposition(metrics)
    assert got["x_run_finished"] == {(): 1.0}
    ratio = {tuple(v for _, v in k): value for k, value in got["x_run_hit_ratio"].items()}
    assert ratio == {
        ("tiered", "device"): 0.5, ("tiered", "host"): 0.2, ("tiered", "storage"): 0.1,
        ("device_only", "device"): 0.0, ("device_only", "host"): 0.0,
        ("device_only", "storage"): 0.0,
    }  # fmt: skip
    ttft = {tuple(v for _, v in k): value for k, value in got["x_run_modeled_ttft_seconds"].items()}
    assert ttft == {("tiered", "0.5"): 0.1, ("tiered", "0.99"): 0.3, ("device_only", "0.5"): 0.2}
    assert got["x_events_total"][(("kind", "a"), ("mode", "device_only"))] == 2.0


def test_an_ended_mode_that_showed_no_cache_has_its_report_only():
    metrics = RunMetrics(prefix="x")
    metrics.on_mode_done("recompute", report(0, 0, 0, 0, 0.0, 0.0))  # no prompt: ratio 0
    _, got = exposition(metrics)
    assert got["x_run_mode_finished"] == {(("mode", "recompute"),): 1.0}
    assert got["x_run_hit_ratio"][(("mode", "recompute"), ("tier", "device"))] == 0.0
    assert "x_events_total" not in got
