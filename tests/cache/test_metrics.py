"""Hit counters and the Prometheus text exposition of ``TieredKVCache.stats()``."""

from __future__ import annotations

import math
import re

import pytest
import torch

from tiered_kv.cache import TieredKVCache
from tiered_kv.cache.metrics import HitCounters, RequestHits, as_dict, prometheus_text
from tiered_kv.config import TieredKVConfig

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
_SAMPLE = re.compile(rf"^({_NAME})(\{{{_LABEL}(?:,{_LABEL})*\}})? (\S+)$")
_LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _unescape(v: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), v)


def parse_prometheus(text: str) -> dict[str, tuple[str, dict[tuple, float]]]:
    """A strict reader of the text format: every family has exactly one ``# TYPE`` line, its
    samples follow it contiguously, each sample is ``name{labels} value`` or ``name value``.
    Returns {family: (type, {sorted label pairs: value})}."""
    families: dict[str, tuple[str, dict[tuple, float]]] = {}
    current = None
    if not text:
        return {}
    assert text.endswith("\n") and "\n\n" not in text
    for line in text[:-1].split("\n"):
        if line.startswith("#"):
            parts = line.split(" ")
            assert parts[:2] == ["#", "TYPE"] and len(parts) == 4, line
            name, kind = parts[2], parts[3]
            assert re.fullmatch(_NAME, name), name
            assert kind in ("counter", "gauge"), line
            assert name not in families, f"second # TYPE line for {name}"
            if current is not None:
                assert families[current][1], f"{current} has no samples"
            families[name] = (kind, {})
            current = name
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        name, labels, value = m.groups()
        assert name == current, f"sample {name} outside its family's block (in {current})"
        pairs = tuple(
            sorted(
                (k, _unescape(v)) for k, v in _LABEL_PAIR.findall(labels[1:-1] if labels else "")
            )
        )
        assert len({k for k, _ in pairs}) == len(pairs), line
        samples = families[name][1]
        assert pairs not in samples, f"duplicate sample {line!r}"
        samples[pairs] = float(value)  # accepts NaN, +Inf, -Inf, 1e-05
    assert current is None or families[current][1]
    return families


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


# -- the text format ------------------------------------------------------------------------------
def test_flattening_labels_and_types():
    stats = {
        "requests": 3,
        "hits": {"prompt": 95, "device": 20, "missed": 7},
        "transfer": {
            "host_to_device": {"bytes": 4096, "seconds": 0.5, "ops": 2, "gbps": 8.192e-06},
            "device_to_host": {"bytes": 0, "seconds": 0.0, "ops": 0, "gbps": 0.0},
        },
        "evictions": {"device": {"tokens": 40, "nodes": 2}, "storage": {"pages": 3}},
        "storage": {"checksum_failures": 1, "errors": 2, "pages": 9},
        "occupancy": {"device_tokens": 36, "host_tokens": 108},
    }
    text = prometheus_text(stats)
    fam = parse_prometheus(text)
    assert fam["tiered_kv_requests"] == ("counter", {(): 3.0})
    assert fam["tiered_kv_hits_tokens_total"] == (
        "counter",
        {(("tier", "prompt"),): 95.0, (("tier", "device"),): 20.0, (("tier", "missed"),): 7.0},
    )
    assert fam["tiered_kv_transfer_bytes"][1] == {
        (("direction", "host_to_device"),): 4096.0,
        (("direction", "device_to_host"),): 0.0,
    }
    assert fam["tiered_kv_transfer_bytes"][0] == "counter"
    assert fam["tiered_kv_transfer_seconds"][0] == "counter"
    assert fam["tiered_kv_transfer_ops"][0] == "counter"
    assert fam["tiered_kv_transfer_gbps"][0] == "gauge"  # a rate, not cumulative
    assert fam["tiered_kv_transfer_gbps"][1][(("direction", "host_to_device"),)] == 8.192e-06
    assert fam["tiered_kv_evictions_tokens"] == ("counter", {(("tier", "device"),): 40.0})
    assert fam["tiered_kv_evictions_pages"] == ("counter", {(("tier", "storage"),): 3.0})
    assert fam["tiered_kv_storage_errors"] == ("counter", {(): 2.0})
    assert fam["tiered_kv_storage_checksum_failures"] == ("counter", {(): 1.0})
    assert fam["tiered_kv_storage_pages"] == ("gauge", {(): 9.0})
    assert fam["tiered_kv_occupancy_device_tokens"] == ("gauge", {(): 36.0})
    # ints print as ints
    assert "tiered_kv_requests 3\n" in text
    assert 'tiered_kv_hits_tokens_total{tier="prompt"} 95\n' in text


def test_skips_non_numbers_and_formats_special_floats():
    stats = {
        "flag": True,
        "name": "x",
        "nothing": None,
        "g": {"ok": 1, "bad": False, "s": "y", "n": None, "nan": math.nan, "inf": math.inf},
        "hits": {"device": 5, "weird": "z"},
        "transfer": {"x": {"bytes": 1, "flag": True}, "y": 3.5},
        "neg": -math.inf,
    }
    text = prometheus_text(stats, prefix="p")
    fam = parse_prometheus(text)
    assert set(fam) == {
        "p_g_ok",
        "p_g_nan",
        "p_g_inf",
        "p_hits_tokens_total",
        "p_transfer_bytes",
        "p_transfer_tokens_total",
        "p_neg",
    }
    assert "p_g_nan NaN\n" in text and "p_g_inf +Inf\n" in text and "p_neg -Inf\n" in text
    assert math.isnan(fam["p_g_nan"][1][()])


def test_label_values_and_names_are_escaped():
    odd = 'a"b\\c\nd'
    stats = {"hits": {odd: 1}, "transfer": {"x-y": {"bytes": 2}}, "bad-group": {"k.v": 3}}
    text = prometheus_text(stats)
    fam = parse_prometheus(text)
    assert fam["tiered_kv_hits_tokens_total"][1] == {(("tier", odd),): 1.0}
    assert fam["tiered_kv_transfer_bytes"][1] == {(("direction", "x-y"),): 2.0}
    assert fam["tiered_kv_bad_group_k_v"][1] == {(): 3.0}


def test_empty_stats():
    assert prometheus_text({}) == ""
    assert prometheus_text({"x": "y", "g": {}}) == ""


# -- a real cache ---------------------------------------------------------------------------------
@pytest.fixture
def cache(tmp_path):
    c = TieredKVCache(
        TieredKVConfig.flat(
            num_layers=2,
            head_num=2,
            head_dim=8,
            page_size=4,
            device_tokens=64,
            host_tokens=128,
            storage_bytes=64 << 20,
            storage_path=str(tmp_path / "store"),
            model_id="test-model@1",
            prefetch_threshold=4,
            prefetch_policy="wait_complete",
        )
    )
    yield c
    c.close()


def _serve(cache: TieredKVCache, prompt: list[int], gen: torch.Generator) -> RequestHits:
    req = cache.begin(prompt)
    slots = cache.extend(req, prompt[req.prefix_len :])
    for layer in range(2):
        k = torch.randn(len(slots), 2, 8, generator=gen)
        cache.write_kv(layer, slots, k, -k)
    cache.finish(req)
    cache.drain()
    return req.hits


def test_cache_exposition_matches_stats(cache, gen):
    fresh = parse_prometheus(cache.prometheus())
    assert fresh["tiered_kv_requests"][1] == {(): 0.0}
    prompts = [[1000 * i + j for j in range(33 + 4 * i)] for i in range(6)]
    hits = [_serve(cache, p, gen) for p in [*prompts, prompts[0], prompts[0]]]
    st = cache.stats()
    fam = parse_prometheus(cache.prometheus())
    total = fam["tiered_kv_hits_tokens_total"]
    assert total[0] == "counter"
    for tier, field in (
        ("prompt", "prompt_tokens"),
        ("device", "device"),
        ("host", "host"),
        ("storage", "storage"),
        ("missed", "missed"),
    ):
        want = sum(getattr(h, field) for h in hits)
        assert total[1][(("tier", tier),)] == want == st["hits"][tier], tier
    assert total[1][(("tier", "storage"),)] > 0 and total[1][(("tier", "device"),)] > 0
    assert fam["tiered_kv_requests"][1][()] == len(hits) == st["requests"]
    for d, s in st["transfer"].items():
        for k in ("bytes", "seconds", "ops", "failed_ops", "gbps"):
            assert fam[f"tiered_kv_transfer_{k}"][1][(("direction", d),)] == pytest.approx(s[k])
    for tier, body in st["evictions"].items():
        for k, v in body.items():
            assert fam[f"tiered_kv_evictions_{k}"][1][(("tier", tier),)] == v
    for k, v in st["storage"].items():
        assert fam[f"tiered_kv_storage_{k}"][1][()] == v
    for k, v in st["occupancy"].items():
        assert fam[f"tiered_kv_occupancy_{k}"] == ("gauge", {(): v})
    for name, (kind, samples) in fam.items():
        if kind == "counter":
            assert all(v >= 0 for v in samples.values()), name


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
