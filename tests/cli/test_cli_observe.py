"""A run's metrics and log level: the endpoint serves what it shows (a live cache's counters as
they change), on loopback, and frees its port when closed; ``tiered-kv run --metrics-port``
serves every mode's series under a ``mode`` label (the serving mode's live, the ended ones'
final), scraped with urllib and read with prometheus_client's parser, and shuts the endpoint
at exit; the real command in a subprocess writes ``--metrics-file`` (every mode, the hit
ratios and modeled TTFT, as in ``--json``) and still answers a scrape after its report
(``--metrics-linger``); ``--log-level`` sends the library's records to the log."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

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
MODES = ("tiered", "device_only", "recompute", "tiered_planner")  # qwen2.5-7b's: no hisparse
SCRIPT = Path(sys.executable).with_name("tiered-kv")
CLI = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "tiered_kv.cli.main"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse(text: str) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label pairs: value}}, read by prometheus_client's parser; each
    family once (one TYPE line a family: the text format wants its samples together)."""
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)), "a family is split"
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        return parse(r.read().decode())


def by_mode(got: dict, name: str, **labels: str) -> dict[str, float]:
    """{mode: value} of the samples of ``name`` with ``labels``."""
    out = {}
    for key, value in got.get(name, {}).items():
        d = dict(key)
        if all(d.get(k) == v for k, v in labels.items()):
            out[d["mode"]] = value
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
        endpoint.show(cache.registry)
        got = scrape(port)
        assert got["tiered_kv_requests_total"] == {(): 0.0}
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
        # The mode's cache has served its workload (and closed) and is still read live; the
        # modes before it are served as they ended.
        seen[mode] = scrape(port)
        return report(mode, *args)

    monkeypatch.setattr(scale_run, "mode_report", scraped_report)
    caplog.set_level(logging.INFO)
    argv = [*RUN, "--store-dir", str(tmp_path), "--metrics-port", str(port), "--no-progress"]
    assert main([*argv, "--log-level", "info", "--json", str(tmp_path / "r.json")]) == 0
    assert tuple(seen) == MODES
    res = json.loads((tmp_path / "r.json").read_text())
    for i, got in enumerate(seen.values()):
        finished = {m: float(j < i) for j, m in enumerate(MODES[: i + 1])}
        assert by_mode(got, "tiered_kv_run_mode_finished") == finished
        assert got["tiered_kv_run_finished"] == {(): 0.0}
        for m in MODES[: i + 1]:  # the ended modes' counters kept, none restarted
            assert by_mode(got, "tiered_kv_requests_total")[m] == res["modes"][m]["requests"] > 0
            sources = by_mode(got, "tiered_kv_prompt_tokens_total", source="device")
            assert sources[m] == res["modes"][m]["hits"]["device"]
            computed = by_mode(got, "tiered_kv_prompt_tokens_total", source="computed")
            assert computed[m] == res["modes"][m]["hits"]["missed"]
        assert set(by_mode(got, "tiered_kv_run_hit_ratio", tier="device")) == set(MODES[:i])
    host = by_mode(seen["tiered_planner"], "tiered_kv_tier_capacity_tokens", tier="host")
    assert host["tiered"] > 0 and "device_only" not in host
    assert refused(port)  # shut down at exit
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("tiered_kv")]
    assert f"metrics at http://127.0.0.1:{port}/metrics" in messages
    assert any(m.startswith("storage opened: ") for m in messages)
    assert logging.getLogger("tiered_kv").level == logging.INFO


def test_metrics_file_holds_every_mode_as_the_json_does(tmp_path):
    prom, js = tmp_path / "out" / "run.prom", tmp_path / "out" / "run.json"
    prom.parent.mkdir()
    argv = [*RUN[1:], "--rounds", "1", "--store-dir", str(tmp_path), "--json", str(js)]
    done = subprocess.run(
        [*CLI, "run", *argv, "--metrics-file", str(prom)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert sorted(os.listdir(prom.parent)) == ["run.json", "run.prom"]  # no temporary left
    got, res = parse(prom.read_text()), json.loads(js.read_text())
    assert set(res["modes"]) == set(MODES)
    for name, samples in got.items():
        if name != "tiered_kv_run_finished":
            assert all("mode" in dict(k) for k in samples), name
    assert got["tiered_kv_run_finished"] == {(): 1.0}
    assert by_mode(got, "tiered_kv_run_mode_finished") == dict.fromkeys(MODES, 1.0)
    for mode, m in res["modes"].items():
        assert by_mode(got, "tiered_kv_requests_total")[mode] == m["requests"] == 2
        for source, key in (("device", "device"), ("host", "host"), ("computed", "missed")):
            tokens = by_mode(got, "tiered_kv_prompt_tokens_total", source=source)
            assert tokens[mode] == m["hits"][key], (mode, source)
        for tier in ("device", "host", "storage"):
            ratio = by_mode(got, "tiered_kv_run_hit_ratio", tier=tier)[mode]
            assert ratio == pytest.approx(m["hits"][tier] / m["prompt_tokens"]), (mode, tier)
        for q, key in (("0.5", "ttft_p50_s"), ("0.99", "ttft_p99_s")):
            ttft = by_mode(got, "tiered_kv_run_modeled_ttft_seconds", quantile=q)[mode]
            assert ttft == pytest.approx(m["modeled"][key]) and ttft > 0
    assert by_mode(got, "tiered_kv_run_hit_ratio", tier="device")["tiered"] > 0
    assert by_mode(got, "tiered_kv_run_hit_ratio", tier="device")["recompute"] == 0
    d2h = by_mode(got, "tiered_kv_transfer_job_seconds_count", direction="device_to_host")
    assert d2h["tiered"] > 0 and d2h["device_only"] == 0
    # Not a terminal: one progress line per mode as it ends.
    lines = [line for line in done.stderr.splitlines() if line.startswith("tiered-kv run: ")]
    assert [line.split()[2] for line in lines] == list(MODES), done.stderr
    assert all(" done: 2/2 turns in " in line for line in lines), lines


def test_the_endpoint_still_answers_after_the_report(tmp_path):
    port, js = free_port(), tmp_path / "run.json"
    argv = [*RUN[1:], "--rounds", "1", "--store-dir", str(tmp_path), "--json", str(js)]
    argv += ["--metrics-port", str(port), "--metrics-linger", "60", "--no-progress"]
    proc = subprocess.Popen(
        [*CLI, "run", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        waiting = ""  # stderr up to the linger's line (a warning may come before it)
        while not waiting.endswith("(Ctrl-C ends)\n"):
            line = proc.stderr.readline()
            assert line, f"ended before lingering: {waiting}"
            waiting += line
        last = waiting.splitlines()[-1]
        assert last.startswith(f"final metrics at http://127.0.0.1:{port}/metrics for 60 s")
        got = scrape(port)  # after the report and the JSON: the final values
        res = json.loads(js.read_text())
        assert got["tiered_kv_run_finished"] == {(): 1.0}
        requests = by_mode(got, "tiered_kv_requests_total")
        assert requests == {m: res["modes"][m]["requests"] for m in MODES}
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)  # ends the wait early, not the run's status
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert time.monotonic() - t0 < 20
    assert proc.returncode == 0, err
    assert "Traceback" not in waiting + err
    assert "tiered_planner vs tiered" in out and out.rstrip().splitlines()[-1].startswith("wall ")
    assert refused(port)


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


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--metrics-linger", "5"], "--metrics-linger 5 needs --metrics-port"),
        (["--metrics-port", "9400", "--metrics-linger", "-1"], "must be >= 0 seconds"),
        (["--metrics-linger", "soon"], "'soon' is not a number of seconds"),
        (["--metrics-file", "{tmp}"], "is a directory; name a file"),
        (["--metrics-file", "{tmp}/missing/run.prom"], "cannot write in {tmp}/missing"),
    ],
)
def test_bad_metrics_linger_and_file_are_refused(argv, expected, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(["run", "--store-dir", str(tmp_path), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert expected.replace("{tmp}", str(tmp_path)) in err, err
    assert "Traceback" not in err
