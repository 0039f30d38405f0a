"""A run's metrics endpoint and log level: the endpoint serves the registry it shows (a live
cache's counters as they change), on loopback, and frees its port when closed; ``tiered-kv run
--metrics-port`` serves each mode's cache while it runs (scraped with urllib at each mode's end
and read with prometheus_client's parser) and shuts the endpoint at exit; ``--log-level``
sends the library's records to the log."""

from __future__ import annotations

import json
import logging
import socket
import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from tiered_kv.cache import TieredKVCache
from tiered_kv.cli.main import main
from tiered_kv.cli.observe import MetricsEndpoint, metrics_endpoint
from tiered_kv.config import TieredKVConfig
from tiered_kv.engine import scale_run

RUN = ["run", "--preset", "qwen2.5-7b", "--users", "2", "--active-users", "1", "--docs", "1"]
RUN += ["--rounds", "2", "--scale", "0.05", "--page-size", "16", "--chunk-tokens", "256"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def refused(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    except (urllib.error.URLError, ConnectionError):
        return True
    return False


@pytest.fixture
def restore_log_level():
    top = logging.getLogger("tiered_kv")
    level = top.level
    yield
    top.setLevel(level)


def test_the_endpoint_serves_what_it_shows_and_frees_its_port(tmp_path, gen):
    cache = TieredKVCache(
        TieredKVConfig.flat(
            num_layers=2, head_num=2, head_dim=8, page_size=4, device_tokens=64,
            host_tokens=128, storage_bytes=64 << 20, storage_path=str(tmp_path / "s"),
            model_id="test-model@1",
        )
    )  # fmt: skip
    endpoint = MetricsEndpoint(0)
    try:
        port = endpoint.port
        assert endpoint.host == "127.0.0.1" and port > 0
        assert endpoint._server.server_address[0] == "127.0.0.1"  # loopback by default
        assert scrape(port) == {}  # nothing shown yet
        endpoint.show(cache.registry, "tiered")
        got = scrape(port)
        assert got["tiered_kv_requests_total"] == {(): 0.0}
        assert got["tiered_kv_run_mode"] == {(("mode", "tiered"),): 1.0}
        prompt = list(range(21))
        req = cache.begin(prompt)
        slots = cache.extend(req, prompt)
        for layer in range(2):
            k = torch.randn(len(slots), 2, 8, generator=gen)
            cache.write_kv(layer, slots, k, -k)
        cache.finish(req)
        cache.drain()
        got = scrape(port)  # the live cache, read at scrape time
        assert got["tiered_kv_requests_total"] == {(): 1.0}
        sources = got["tiered_kv_prompt_tokens_total"]
        assert sources[(("source", "computed"),)] == 21
        assert got["tiered_kv_transfer_job_seconds_count"][(("direction", "device_to_host"),)] == 1
        other = CollectorRegistry()
        Counter("other_events", "Another registry's counter.", registry=other).inc(3)
        endpoint.show(other)
        got = scrape(port)
        assert got["other_events_total"] == {(): 3.0}
        assert not any(name.startswith("tiered_kv") for name in got)
    finally:
        endpoint.close()
        cache.close()
    assert refused(port)
    endpoint.close()  # twice is fine


def test_port_zero_is_no_endpoint():
    with metrics_endpoint(0) as endpoint:
        assert endpoint is None


def test_run_serves_each_modes_metrics_and_closes_the_endpoint(
    tmp_path, monkeypatch, caplog, restore_log_level
):
    port = free_port()
    seen = {}
    report = scale_run.mode_report

    def scraped_report(mode, *args):
        # Each mode's cache has served its workload (and closed) and is still the one shown.
        seen[mode] = scrape(port)
        return report(mode, *args)

    monkeypatch.setattr(scale_run, "mode_report", scraped_report)
    caplog.set_level(logging.INFO)
    argv = [*RUN, "--store-dir", str(tmp_path), "--metrics-port", str(port)]
    assert main([*argv, "--log-level", "info", "--json", str(tmp_path / "r.json")]) == 0
    assert set(seen) == {"tiered", "device_only", "recompute", "tiered_planner"}
    res = json.loads((tmp_path / "r.json").read_text())
    for mode, got in seen.items():
        assert got["tiered_kv_run_mode"] == {(("mode", mode),): 1.0}
        m = res["modes"][mode]
        assert got["tiered_kv_requests_total"][()] == m["requests"] > 0
        sources = {dict(k)["source"]: v for k, v in got["tiered_kv_prompt_tokens_total"].items()}
        assert sources["device"] == m["hits"]["device"]
        assert sources["computed"] == m["hits"]["missed"]
    assert seen["tiered"]["tiered_kv_tier_capacity_tokens"][(("tier", "host"),)] > 0
    assert (("tier", "host"),) not in seen["device_only"]["tiered_kv_tier_capacity_tokens"]
    assert refused(port)  # shut down at exit
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("tiered_kv")]
    assert f"metrics at http://127.0.0.1:{port}/metrics" in messages
    assert any(m.startswith("storage opened: ") for m in messages)
    assert logging.getLogger("tiered_kv").level == logging.INFO


def test_log_level_warning_keeps_info_out(tmp_path, caplog, restore_log_level):
    caplog.set_level(logging.DEBUG)  # the handler takes everything; the level decides
    assert main([*RUN, "--store-dir", str(tmp_path), "--rounds", "1"]) == 0
    assert logging.getLogger("tiered_kv").level == logging.WARNING  # the default
    assert not [r for r in caplog.records if r.name.startswith("tiered_kv") and r.levelno < 30]


@pytest.mark.parametrize("bad", ["-1", "70000", "http"])
def test_bad_metrics_port_is_refused(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--metrics-port", bad])
    assert exc.value.code == 2
    assert "--metrics-port" in capsys.readouterr().err
