"""Hit counters and the cache's Prometheus exposition (``TieredKVCache.prometheus()``, read back
with prometheus_client's own parser): HELP and TYPE for every family, ``_total`` counters,
labels whose sums are totals, counters equal to ``stats()``, one histogram observation per
transfer job of each direction, occupancy gauges, one registry per cache."""

from __future__ import annotations

import threading

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from tiered_kv.cache import TieredKVCache
from tiered_kv.cache.metrics import HitCounters, RequestHits, as_dict
from tiered_kv.cache.transfer_metrics import BYTES_BUCKETS, SECONDS_BUCKETS
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import Direction

DIRECTIONS = Direction.values()


def scrape(text: str) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label pairs: value}} of an exposition, read by prometheus_client's
    parser (which also checks the format)."""
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = tuple(sorted(s.labels.items()))
            assert key not in out.setdefault(s.name, {}), f"duplicate sample {s}"
            out[s.name][key] = s.value
    return out


def by_label(samples: dict[str, dict[tuple, float]], name: str, label: str) -> dict[str, float]:
    """``name``'s samples keyed by their one label ``label``."""
    out = {}
    for key, value in samples[name].items():
        labels = dict(key)
        assert set(labels) == {label}, (name, labels)
        out[labels[label]] = value
    return out


# -- hit counters ---------------------------------------------------------------------------------
def test_request_hits_and_counters():
    assert RequestHits() == RequestHits(0, 0, 0, 0, 0)
    c = HitCounters()
    c.add(RequestHits(37, 0, 0, 36, 1))
    c.add(RequestHits(53, 20, 12, 20, 1))
    c.add(RequestHits(5, 0, 0, 0, 5))
    assert as_dict(c) == {
        "requests": 3,
        "prompt_tokens": 95,
        "device": 20,
        "host": 12,
        "storage": 56,
        "missed": 7,
    }
    assert as_dict(RequestHits(4, 1, 1, 1, 1))["storage"] == 1


# -- a real cache ---------------------------------------------------------------------------------
def _config(tmp_path, **over) -> TieredKVConfig:
    kw = dict(
        num_layers=2, head_num=2, head_dim=8, page_size=4, device_tokens=64, host_tokens=128,
        storage_bytes=64 << 20, storage_path=str(tmp_path / "store"), model_id="test-model@1",
        prefetch_threshold=4, prefetch_policy="wait_complete",
    )  # fmt: skip
    return TieredKVConfig.flat(**{**kw, **over})


@pytest.fixture
def cache(tmp_path):
    c = TieredKVCache(_config(tmp_path))
    yield c
    c.close()


def _write(cache: TieredKVCache, slots: torch.Tensor, gen: torch.Generator) -> None:
    for layer in range(2):
        k = torch.randn(len(slots), 2, 8, generator=gen)
        cache.write_kv(layer, slots, k, -k)


def _serve(cache: TieredKVCache, prompt: list[int], gen: torch.Generator) -> RequestHits:
    req = cache.begin(prompt)
    _write(cache, cache.extend(req, prompt[req.prefix_len :]), gen)
    cache.finish(req)
    cache.drain()
    return req.hits


def _prompts(n: int, base: int = 0) -> list[list[int]]:
    return [[base + 1000 * i + j for j in range(33 + 4 * i)] for i in range(n)]


def test_every_family_has_help_and_type_and_counters_end_in_total(cache, gen):
    for p in _prompts(3):
        _serve(cache, p, gen)
    text = cache.prometheus()
    lines = text.splitlines()
    helps = {ln.split(" ")[2]: ln for ln in lines if ln.startswith("# HELP ")}
    types = {ln.split(" ")[2]: ln.split(" ")[3] for ln in lines if ln.startswith("# TYPE ")}
    assert set(helps) == set(types) and len(types) > 30
    assert all(len(h.split(" ", 3)[3]) > 10 for h in helps.values()), "a HELP without text"
    families = list(text_string_to_metric_families(text))
    kinds = {f.name: f.type for f in families}
    assert {kinds[n] for n in kinds} <= {"counter", "gauge", "histogram"}
    for f in families:
        if f.type == "counter":
            assert {s.name for s in f.samples} <= {f"{f.name}_total", f"{f.name}_created"}, f.name
            assert any(s.name == f"{f.name}_total" for s in f.samples), f.name
        assert not f.name.endswith("_total"), f"{f.name}: _total belongs on the sample only"
    counters = [n for n, k in kinds.items() if k == "counter"]
    assert all(f"\n{n}_total" in text for n in counters)
    # The old double-counting label is gone: no label anywhere says "prompt".
    assert all("prompt" not in s.labels.values() for f in families for s in f.samples)
    for name in ("tiered_kv_requests", "tiered_kv_prompt_tokens", "tiered_kv_evicted_tokens"):
        assert kinds[name] == "counter"
    for name in ("tiered_kv_transfer_job_seconds", "tiered_kv_transfer_job_bytes"):
        assert kinds[name] == "histogram"
    assert kinds["tiered_kv_tier_cached_tokens"] == "gauge"


def test_counters_equal_stats_and_sums_over_labels_are_totals(cache, gen):
    fresh = scrape(cache.prometheus())
    assert fresh["tiered_kv_requests_total"] == {(): 0.0}
    prompts = _prompts(6)
    hits = [_serve(cache, p, gen) for p in [*prompts, prompts[0], prompts[0]]]
    st = cache.stats()
    got = scrape(cache.prometheus())
    assert got["tiered_kv_requests_total"][()] == len(hits) == st["requests"]
    sources = by_label(got, "tiered_kv_prompt_tokens_total", "source")
    want = {"device": "device", "host": "host", "storage": "storage", "computed": "missed"}
    for source, key in want.items():
        assert sources[source] == sum(getattr(h, key) for h in hits) == st["hits"][key], source
    assert sources["storage"] > 0 and sources["device"] > 0
    # Each prompt token is counted once, under where its KV came from.
    assert (
        sum(sources.values())
        == st["hits"]["prompt"]
        == sum(len(p) for p in prompts) + 2 * len(prompts[0])
    )
    for name, key in (("evicted_tokens", "tokens"), ("evicted_nodes", "nodes")):
        tiers = by_label(got, f"tiered_kv_{name}_total", "tier")
        assert tiers == {t: st["evictions"][t][key] for t in ("device", "host")}
        assert sum(tiers.values()) == sum(st["evictions"][t][key] for t in ("device", "host"))
    assert st["evictions"]["device"]["tokens"] > 0 and st["evictions"]["host"]["tokens"] > 0
    dropped = by_label(got, "tiered_kv_dropped_tokens_total", "tier")
    assert dropped == {t: st["evictions"][t]["dropped_tokens"] for t in ("device", "host")}
    assert (
        got["tiered_kv_host_writes_skipped_total"][()] == st["evictions"]["host"]["writes_skipped"]
    )
    assert got["tiered_kv_storage_evicted_pages_total"][()] == st["evictions"]["storage"]["pages"]
    for key in ("bytes", "seconds", "ops", "failed_ops"):
        values = by_label(got, f"tiered_kv_transfer_{key}_total", "direction")
        assert set(values) == set(DIRECTIONS)
        for d, s in st["transfer"].items():
            assert values[d] == pytest.approx(s[key]), (key, d)
        assert sum(values.values()) == pytest.approx(sum(s[key] for s in st["transfer"].values()))
    assert got["tiered_kv_transfer_bytes_total"][(("direction", "storage_to_host"),)] > 0
    for key in ("errors", "checksum_failures", "reopens", "turned_off", "skipped_while_off"):
        assert got[f"tiered_kv_storage_{key}_total"][()] == st["storage"][key], key
    assert got["tiered_kv_storage_off"][()] == st["storage"]["off"] == 0
    assert got["tiered_kv_storage_pages"][()] == st["storage"]["pages"] > 0
    for key, value in st["window"].items():
        assert got[f"tiered_kv_window_{key}_total"][()] == value
    state = st["state"]
    assert by_label(got, "tiered_kv_state_restored_total", "tier") == {
        t: state[f"restored_{t}"] for t in ("device", "host", "storage")
    }
    assert got["tiered_kv_state_captured_total"][()] == state["captured"]


def _count_worker_results(cache: TieredKVCache) -> dict[str, list]:
    """Every result the workers report, by direction, seen below the job table."""
    seen: dict[str, list] = {d: [] for d in DIRECTIONS}
    for worker in (cache.device_host, cache.host_storage):
        poll = worker.poll

        def counted(poll=poll):
            results = poll()
            for r in results:
                seen[str(r.direction)].append(r)
            return results

        worker.poll = counted
    return seen


def _histograms(cache: TieredKVCache) -> dict[str, dict]:
    got = scrape(cache.prometheus())
    out = {}
    for d in DIRECTIONS:
        lab = (("direction", d),)
        h = {}
        for kind, bounds in (("seconds", SECONDS_BUCKETS), ("bytes", BYTES_BUCKETS)):
            name = f"tiered_kv_transfer_job_{kind}"
            les = [floatToGoString(b) for b in bounds]
            buckets = [got[f"{name}_bucket"][tuple(sorted((*lab, ("le", le))))] for le in les]
            inf = got[f"{name}_bucket"][tuple(sorted((*lab, ("le", "+Inf"))))]
            assert buckets == sorted(buckets) and buckets[-1] <= inf
            assert inf == got[f"{name}_count"][lab]
            h[kind] = (got[f"{name}_count"][lab], got[f"{name}_sum"][lab])
        h["failed"] = got["tiered_kv_transfer_failed_jobs_total"][lab]
        out[d] = h
    return out


def test_histograms_count_each_job_of_each_direction_once(cache, gen):
    seen = _count_worker_results(cache)
    assert all(h["seconds"] == (0, 0) and h["failed"] == 0 for h in _histograms(cache).values())
    prompts = _prompts(4)
    for p in prompts:
        _serve(cache, p, gen)
    cache.manager.evict_device(1 << 62)  # host copies stay: the next serve loads from host
    assert _serve(cache, prompts[-1], gen).host > 0
    cache.clear_tree()
    assert _serve(cache, prompts[0], gen).storage > 0
    # Three requests finished together: their writes are one merged job, observed once.
    before = len(seen["device_to_host"])
    reqs = cache.begin_many(_prompts(3, base=500_000)[:3])
    for r in reqs:
        _write(cache, cache.extend(r, r.tokens[r.prefix_len :] or [7] * 9), gen)
    cache.finish_many(reqs)
    cache.drain()
    assert len(seen["device_to_host"]) == before + 1
    h = _histograms(cache)
    for d in DIRECTIONS:
        ok = [r for r in seen[d] if r.ok]
        assert ok, f"the workload ran no {d} job"
        assert h[d]["seconds"][0] == h[d]["bytes"][0] == len(ok), d
        assert h[d]["bytes"][1] == sum(r.nbytes for r in ok), d
        assert h[d]["seconds"][1] == pytest.approx(sum(r.seconds for r in ok)), d
        assert h[d]["failed"] == len(seen[d]) - len(ok) == 0, d


def test_refused_jobs_are_counted_failed(cache, gen):
    cache.host_storage.close()  # every backup from now on is refused
    _serve(cache, _prompts(1)[0], gen)
    h = _histograms(cache)
    assert h["host_to_storage"]["failed"] >= 1 and h["host_to_storage"]["seconds"][0] == 0
    assert h["device_to_host"]["failed"] == 0 and h["device_to_host"]["seconds"][0] == 1


def test_a_failed_merged_job_is_one_storage_error(cache, gen):
    """Three requests' backups go as one storage job; the store worker raising on it is one
    failed job and one storage error (not one more for the part that carried the message)."""

    def broken(job):
        raise OSError("disk gone")

    cache.host_storage.submit = broken
    prompts = _prompts(3, base=70_000)
    reqs = [cache.begin(p[:17]) for p in prompts]
    for r, p in zip(reqs, prompts, strict=True):
        _write(cache, cache.extend(r, p[:17]), gen)
    cache.finish_many(reqs)
    cache.drain()
    got = scrape(cache.prometheus())
    assert got["tiered_kv_storage_errors_total"][()] == cache.stats()["storage"]["errors"] == 1
    assert got["tiered_kv_transfer_failed_jobs_total"][(("direction", "host_to_storage"),)] == 1


def test_occupancy_gauges_match_stats_and_free_sizes(cache, gen):
    def gauges():
        got = scrape(cache.prometheus())
        return {
            key: by_label(got, f"tiered_kv_tier_{key}", "tier")
            for key in ("capacity_tokens", "used_tokens", "cached_tokens", "capacity_bytes")
        } | {"storage": (got["tiered_kv_storage_used_bytes"][()], got["tiered_kv_storage_pages"])}

    empty = gauges()
    assert empty["used_tokens"] == {"device": 0, "host": 0}
    assert empty["capacity_tokens"] == {"device": 64, "host": 128}
    for p in _prompts(3):
        _serve(cache, p, gen)
    running = cache.begin(_prompts(1, base=9000)[0])
    cache.extend(running, running.tokens[running.prefix_len :] or [1])
    g, st, free = gauges(), cache.stats(), cache.free_sizes()
    occ = st["occupancy"]
    assert g["cached_tokens"] == {"device": occ["device_tokens"], "host": occ["host_tokens"]}
    assert g["used_tokens"] == {t: g["capacity_tokens"][t] - free[t] for t in ("device", "host")}
    assert g["used_tokens"]["device"] > g["cached_tokens"]["device"]  # the running request's
    assert g["capacity_bytes"]["device"] == cache.device_pool.get_kv_size_bytes()
    assert g["capacity_bytes"]["host"] == cache.host_pool.nbytes
    assert g["capacity_bytes"]["storage"] == 64 << 20
    store = cache.storage.stats()
    assert g["storage"] == (store.bytes, {(): st["storage"]["pages"]}) and store.bytes > 0
    cache.abort(running)


def test_each_cache_has_its_own_registry_or_the_one_given(tmp_path, gen):
    a = TieredKVCache(_config(tmp_path / "a"))
    mine = CollectorRegistry()
    b = TieredKVCache(_config(tmp_path / "b"), registry=mine)
    try:
        assert b.registry is mine and a.registry is not mine
        _serve(a, _prompts(1)[0], gen)
        assert scrape(a.prometheus())["tiered_kv_requests_total"][()] == 1
        assert scrape(b.prometheus())["tiered_kv_requests_total"][()] == 0
        assert generate_latest(mine).decode() == b.prometheus()
        threads = set(threading.enumerate())
        with pytest.raises(InvalidArgumentError, match="own CollectorRegistry"):
            TieredKVCache(_config(tmp_path / "c"), registry=mine)
        assert set(threading.enumerate()) == threads  # refused before anything was built
        assert scrape(b.prometheus())["tiered_kv_requests_total"][()] == 0
    finally:
        a.close()
        b.close()


def test_exposition_after_close(tmp_path, gen):
    c = TieredKVCache(_config(tmp_path))
    _serve(c, _prompts(1)[0], gen)
    c.close()
    got = scrape(c.prometheus())
    assert got["tiered_kv_requests_total"][()] == 1
    assert got["tiered_kv_transfer_job_seconds_count"][(("direction", "device_to_host"),)] == 1


def test_stats_counters_only_grow(cache, gen):
    before = cache.stats()
    _serve(cache, list(range(41)), gen)
    _serve(cache, list(range(41)), gen)
    after = cache.stats()
    assert after["requests"] == before["requests"] + 2
    for tier in before["hits"]:
        assert after["hits"][tier] >= before["hits"][tier]
    assert after["hits"]["device"] == 40 and after["hits"]["missed"] == 41 + 1
    for d in before["transfer"]:
        for k in ("bytes", "ops"):
            assert after["transfer"][d][k] >= before["transfer"][d][k]
    assert after["transfer"]["device_to_host"]["ops"] >= 1
    assert after["storage"]["pages"] == 10
