"""``--json PATH`` of ``run-reference``, ``sim`` and ``bench``: the keys are exactly the README's
table (parsed from README.md, so the documentation and the output cannot drift apart), the values
are sane, the printed table shows the same numbers; ``run-reference`` reuses its store across runs
and ``--fresh`` empties it; ``sim --plot`` writes a PNG. ``run``'s JSON (the scale run) is checked
against the same table in tests/engine/test_scale_run.py."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from tiered_kv.cli import run_cmd
from tiered_kv.cli.main import main
from tiered_kv.tree.policies import POLICIES

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(autouse=True)
def _no_default_store(monkeypatch, tmp_path):
    """Never touch the default ~/.cache store, even if a check stops failing and
    `run-reference` runs."""
    monkeypatch.setattr(run_cmd, "default_cache_dir", lambda: tmp_path / "cache")


RUN_ARGS = [
    "--no-progress",
    *("--users", "2", "--rounds", "2", "--system-tokens", "64", "--question-tokens", "16"),
    *("--answer-tokens", "4", "--layers", "2", "--hidden", "32", "--heads", "2"),
    *("--kv-heads", "1", "--head-dim", "16", "--page-size", "8", "--device-tokens", "128"),
    *("--host-tokens", "128", "--storage-mib", "16"),
]
SIM_ARGS = [
    "--no-progress",
    *("--users", "3", "--rounds", "2", "--shared-prompt", "64", "--history", "0"),
    *("--answer", "16", "--block-size", "16", "--capacities", "0.2,0.5"),
]
BENCH_ARGS = [
    "--no-progress",
    *("--tokens", "64", "--layers", "2", "--kv-heads", "1", "--head-dim", "16"),
    *("--page-sizes", "8,16", "--repeats", "1"),
]
TRANSFER_DIRECTIONS = ("device_to_host", "host_to_device", "host_to_storage", "storage_to_host")


# -- the README table -----------------------------------------------------------------------------
def _parse_cell(cell: str) -> dict[str, dict]:
    """``a``, ``b`` (``x``, ``y``), ``c`` (each: ``z``) -> {a: {...}, b: {keys: [x, y]}, ...}.

    ``each:`` / ``per direction:`` / ``per mode:`` mark keys of every item of a list / dict
    value."""
    keys: dict[str, dict] = {}
    depth, current = 0, None
    for m in re.finditer(r"`([^`]+)`|\(|\)|each:|per \w+:", cell):
        tok = m.group(0)
        if tok == "(":
            depth += 1
        elif tok == ")":
            depth -= 1
        elif tok == "each:" or tok.startswith("per "):
            assert depth == 1 and current is not None
            keys[current]["items"] = True
        elif depth == 0:
            current = m.group(1)
            keys[current] = {"keys": [], "items": False}
        else:
            keys[current]["keys"].append(m.group(1))
    assert depth == 0, cell
    return keys


def readme_keys() -> dict[str, dict[str, dict]]:
    text = README.read_text()
    start = text.index("JSON output (`--json PATH`)")
    end = text.find("\n\n", text.index("\n|", start))  # that table only, not later ones
    rows = re.findall(r"^\| `([\w-]+)` \| (.+) \|$", text[start:end], flags=re.M)
    return {command: _parse_cell(cell) for command, cell in rows}


def test_readme_table_parses():
    keys = readme_keys()
    assert set(keys) == {"run", "run-reference", "sim", "bench"}
    for table in keys.values():
        assert "command" in table and len(table) >= 4
    assert keys["run"]["modes"]["items"] is True
    assert {"hits", "modeled", "verification"} <= set(keys["run"]["modes"]["keys"])
    assert keys["run"]["load_average"]["keys"] == ["before", "after"]
    assert keys["run-reference"]["hits"]["keys"] == ["device", "host", "storage", "recomputed"]
    assert keys["run-reference"]["transfers"]["items"] is True
    assert keys["sim"]["rows"]["items"] is True and "hit_rate" in keys["sim"]["rows"]["keys"]
    assert keys["bench"]["host_storage"]["items"] is False


def _check_documented_keys(command: str, result: dict, skip: frozenset = frozenset()) -> None:
    doc = readme_keys()[command]
    assert set(result) == set(doc) - skip, f"{command}: JSON keys differ from README.md"
    for key, spec in doc.items():
        if key in skip or not spec["keys"]:
            continue
        value = result[key]
        if spec["items"]:
            items = list(value.values()) if isinstance(value, dict) else value
            assert items, key
        else:
            items = [value]
        for item in items:
            assert set(item) == set(spec["keys"]), f"{command}.{key}: {sorted(item)}"


# -- run-reference --------------------------------------------------------------------------------
def _run(argv: list[str]) -> tuple[int, dict, str]:
    json_path = Path(argv[argv.index("--store") + 1]).parent / f"run{len(argv)}-{id(argv)}.json"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["run-reference", *RUN_ARGS, *argv, "--json", str(json_path)])
    return code, json.loads(json_path.read_text()), buf.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """First run on an empty store, a second on the same store, then a --fresh one."""
    store = str(tmp_path_factory.mktemp("run") / "store")
    first = _run(["--store", store])
    second = _run(["--store", store])
    fresh = _run(["--store", store, "--fresh", "--no-verify"])
    return {"first": first, "second": second, "fresh": fresh, "store": store}


def test_run_reference_json_matches_readme_and_is_sane(runs):
    code, res, _ = runs["first"]
    assert code == 0
    _check_documented_keys("run-reference", res)
    assert res["command"] == "run-reference"
    assert res["store"] == runs["store"]
    assert set(TRANSFER_DIRECTIONS) <= set(res["transfers"])
    cfg = res["config"]
    assert (cfg["users"], cfg["rounds"], cfg["page_size"]) == (2, 2, 8)
    assert "json" not in cfg and "config" not in cfg

    assert res["requests"] == 4 == len(res["per_request"])
    assert res["generated_tokens"] == 4 * 4
    assert res["prompt_tokens"] == sum(r["prompt_tokens"] for r in res["per_request"])
    assert sum(res["hits"].values()) == res["prompt_tokens"]
    for r in res["per_request"]:
        assert r["device"] + r["host"] + r["storage"] + r["recomputed"] == r["prompt_tokens"]
    for tier in ("device", "host", "storage", "recomputed"):
        assert res["hits"][tier] == sum(r[tier] for r in res["per_request"])
    # The tiers are sized to overflow: pages went down to host and to the store.
    for direction in ("device_to_host", "host_to_storage"):
        assert res["transfers"][direction]["bytes"] > 0
        assert res["transfers"][direction]["ops"] > 0
    for t in res["transfers"].values():
        assert t["failed_ops"] == 0 and t["bytes"] >= 0 and t["gbps"] >= 0
    assert res["storage"]["checksum_failures"] == 0 and res["storage"]["errors"] == 0

    v = res["verification"]
    assert v["passed"] is True
    assert v["requests"] == 4 and 0 <= v["bitwise"] <= 4
    assert 0 <= v["max_rel_diff"] <= v["tolerance"]
    t = res["ttft"]
    assert 0 <= t["requests_compared"] <= 4
    if t["requests_compared"]:
        assert t["restored_median_s"] > 0 and t["recompute_median_s"] > 0
        assert t["speedup"] == pytest.approx(t["recompute_median_s"] / t["restored_median_s"])
    assert res["elapsed_s"] > 0


def test_run_reference_printed_report_shows_the_json_totals(runs):
    _, res, out = runs["first"]
    assert (
        f"{res['requests']} requests, {res['prompt_tokens']} prompt tokens, "
        f"{res['generated_tokens']} generated" in out
    )
    for tier, tokens in res["hits"].items():
        share = 100 * tokens / res["prompt_tokens"]
        assert re.search(rf"^{tier}\s+{tokens}\s+{share:.1f}%$", out, flags=re.M), tier
    for direction, t in res["transfers"].items():
        assert re.search(rf"^{direction}\s.*\s{t['ops']}\s+{t['failed_ops']}$", out, flags=re.M)
    v = res["verification"]
    assert f"verification: {v['requests']} requests" in out
    assert f"{v['bitwise']} bitwise equal" in out and "PASS" in out


def test_run_reference_second_run_reuses_the_store(runs):
    _, first, _ = runs["first"]
    code, second, _ = runs["second"]
    assert code == 0
    # Nothing is cached before the first request of an empty store...
    assert first["per_request"][0]["recomputed"] == first["per_request"][0]["prompt_tokens"]
    # ...but after a restart the same first request is served from the first run's pages.
    # (Later requests' storage hits vary from run to run with the asynchronous tiers, so only
    # the first request, which nothing else in the run could serve, is compared exactly.)
    req0 = second["per_request"][0]
    assert req0["storage"] > 0 and req0["recomputed"] < req0["prompt_tokens"]
    assert req0["storage"] % 8 == 0  # whole pages
    assert second["hits"]["storage"] >= req0["storage"]
    assert second["transfers"]["storage_to_host"]["bytes"] > 0
    # KV restored from disk gives the same logits as recomputing.
    assert second["verification"]["passed"] is True


def test_run_reference_another_model_of_the_same_kv_shape_never_reads_its_pages(runs, tmp_path):
    """Issue 12: ``--hidden 64`` on the store the ``--hidden 32`` runs filled has the same KV
    shape but other weights; it reused their pages and failed verification (0 of 18 bitwise)."""
    import shutil

    store = str(tmp_path / "store")
    shutil.copytree(runs["store"], store)
    code, other, _ = _run(["--store", store, "--hidden", "64"])
    assert code == 0
    req0 = other["per_request"][0]  # only the other model's pages could serve it
    assert req0["storage"] == 0 and req0["recomputed"] == req0["prompt_tokens"]
    assert other["verification"]["passed"] is True
    assert other["verification"]["bitwise"] == other["verification"]["requests"]
    code, same, _ = _run(["--store", store, "--no-verify"])  # the first model still hits
    assert code == 0 and same["per_request"][0]["storage"] > 0


def test_run_reference_on_a_shared_redis_store(tmp_path):
    """Two runs, two caches, one redis-server: the second starts with the first's pages as
    storage hits, and every logit still equals the no-cache run's."""
    from tests.storage.redis_server import RedisServer

    server = RedisServer()
    try:
        options = json.dumps({"url": server.url})
        remote = ["--storage-backend", "redis", "--storage-options", options]
        first = _run(["--store", str(tmp_path / "unused"), *remote])
        second = _run(["--store", str(tmp_path / "unused"), *remote])
    finally:
        server.stop()
    for code, res, _ in (first, second):
        assert code == 0 and res["verification"]["passed"] is True
        assert res["storage"]["errors"] == 0 and res["storage"]["checksum_failures"] == 0
        assert res["transfers"]["host_to_storage"]["bytes"] > 0
    assert second[1]["hits"]["storage"] > first[1]["hits"]["storage"]
    assert second[1]["transfers"]["storage_to_host"]["bytes"] > 0
    assert not (tmp_path / "unused").exists()  # nothing was written locally


def test_run_reference_fresh_empties_the_store(runs):
    _, first, _ = runs["first"]
    code, fresh, out = runs["fresh"]
    assert code == 0
    req0 = fresh["per_request"][0]
    assert req0["storage"] == 0 and req0["recomputed"] == req0["prompt_tokens"]
    keys = ("prompt_tokens", "device", "host", "storage", "recomputed")
    assert [req0[k] for k in keys] == [first["per_request"][0][k] for k in keys]
    assert fresh["prompt_tokens"] == first["prompt_tokens"]
    # --no-verify: documented keys stay, values say "not measured".
    _check_documented_keys("run-reference", fresh)
    assert fresh["verification"]["passed"] is None and fresh["verification"]["requests"] == 0
    assert fresh["ttft"]["speedup"] is None
    assert "verification: skipped" in out


# -- sim ------------------------------------------------------------------------------------------
def _check_sim_rows(res: dict) -> None:
    for r in res["rows"]:
        rates = ("device_rate", "host_rate", "storage_rate", "hit_rate", "effective_rate")
        for k in (*rates, "total_rate"):
            assert 0.0 <= r[k] <= 1.0, (k, r)
        assert r["hit_rate"] == pytest.approx(r["device_rate"] + r["host_rate"] + r["storage_rate"])
        assert r["hit_rate"] <= r["total_rate"] + 1e-12
        assert r["effective_rate"] <= r["total_rate"]
        if r["effective_rate"]:
            assert r["of_optimum"] == pytest.approx(r["hit_rate"] / r["effective_rate"])
        assert r["device_blocks"] >= 1 and r["seconds"] >= 0


def test_sim_json_matches_readme_and_the_table(capsys, tmp_path):
    path = tmp_path / "sub" / "sim.json"
    path.parent.mkdir()  # --json's folder must exist (checked before the run, issue 30)
    assert main(["sim", *SIM_ARGS, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    res = json.loads(path.read_text())
    _check_documented_keys("sim", res)
    assert res["command"] == "sim"
    assert res["source"] == "multi-round"
    assert res["write_policy"] == "write_through" and res["inclusive_tiers"] is True
    assert res["host_ratio"] == 2.0
    assert res["requests"] == 3 * 2
    assert 0 < res["unique_blocks"] <= res["accesses"]
    assert [(r["capacity"], r["policy"]) for r in res["rows"]] == [
        (c, p) for c in (0.2, 0.5) for p in POLICIES
    ]
    _check_sim_rows(res)
    for r in res["rows"]:
        assert r["device_blocks"] == max(1, round(r["capacity"] * res["unique_blocks"]))
        assert r["host_blocks"] == 2 * r["device_blocks"] and r["storage_blocks"] == 0
    # A larger capacity never lowers the optimum.
    assert res["rows"][-1]["effective_rate"] >= res["rows"][0]["effective_rate"]
    assert res["of_optimum_uses"] == "effective"
    for r in res["rows"]:  # write_through, host = 2 x device: inclusive, host blocks distinct
        assert r["effective_blocks"] == r["host_blocks"] == 2 * r["device_blocks"]
        assert r["total_blocks"] == 3 * r["device_blocks"]
    assert any(r["host_rate"] > 0 for r in res["rows"])  # the default shows the host tier

    assert (
        f"multi-round: {res['requests']} requests, {res['accesses']} block accesses, "
        f"{res['unique_blocks']} unique blocks" in out
    )
    for r in res["rows"]:
        cells = [
            f"{r['capacity']:g} ({r['device_blocks']} blk)",
            r["policy"],
            *(f"{100 * r[k]:.1f}%" for k in ("device_rate", "host_rate", "storage_rate")),
            f"{100 * r['hit_rate']:.1f}%",
            f"{100 * r['effective_rate']:.1f}% ({r['effective_blocks']})",
            f"{100 * r['total_rate']:.1f}% ({r['total_blocks']})",
        ]
        assert re.search(r"^" + r"\s+".join(map(re.escape, cells)), out, flags=re.M), cells


def test_sim_trace_file(capsys, tmp_path):
    """A Mooncake JSONL written here: hit rates follow from the trace by hand."""
    prefix = [1, 2, 3, 4]
    requests = [prefix + [10], prefix + [11], prefix + [10], [20, 21], prefix + [11, 12]]
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "\n".join(
            json.dumps(
                {"timestamp": i, "input_length": 16 * len(ids), "output_length": 2, "hash_ids": ids}
            )
            for i, ids in enumerate(requests)
        )
        + "\n"
    )
    path = tmp_path / "trace.json"
    argv = ["sim", "--no-progress", "--trace", str(trace), "--capacities", "1.0,2"]
    assert main([*argv, "--policies", "lru,fifo", "--storage", "3", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    res = json.loads(path.read_text())
    _check_documented_keys("sim", res)
    accesses = sum(len(ids) for ids in requests)
    unique = len({i for ids in requests for i in ids})
    assert res["source"] == str(trace)
    assert (res["requests"], res["accesses"], res["unique_blocks"]) == (5, accesses, unique)
    _check_sim_rows(res)
    full = [r for r in res["rows"] if r["capacity"] == 1.0]
    assert len(full) == 2
    for r in full:
        # Room for every block: each block misses once, then always hits.
        assert r["device_blocks"] == unique
        assert r["hit_rate"] == pytest.approx((accesses - unique) / accesses)
        assert r["effective_rate"] == pytest.approx((accesses - unique) / accesses)
    for r in res["rows"]:
        assert r["storage_blocks"] == 3
    assert [r["device_blocks"] for r in res["rows"] if r["capacity"] == 2] == [2, 2]
    assert f"{trace}: 5 requests, {accesses} block accesses, {unique} unique blocks" in out
    # --max-requests cuts the trace.
    assert main([*argv, "--max-requests", "2", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["requests"] == 2


def test_sim_plot_writes_a_png(capsys, tmp_path):
    png = tmp_path / "hit.png"
    assert main(["sim", *SIM_ARGS, "--policies", "lru", "--plot", str(png)]) == 0
    assert f"plot: {png}" in capsys.readouterr().out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 1000


@pytest.mark.parametrize("where", ["missing-dir", "under-a-file", "a-directory"])
def test_sim_unwritable_plot_path_fails_before_any_work(capsys, tmp_path, monkeypatch, where):
    from tiered_kv.cli import sim_cmd

    def no_work(*a, **k):
        raise AssertionError("the sweep ran before the plot path was checked")

    monkeypatch.setattr(sim_cmd, "sweep", no_work)
    monkeypatch.setattr(sim_cmd, "load_trace", no_work)
    if where == "missing-dir":
        png = tmp_path / "nowhere" / "hit.png"
    elif where == "under-a-file":
        (tmp_path / "file").write_text("x")
        png = tmp_path / "file" / "hit.png"
    else:
        png = tmp_path / "dir.png"
        png.mkdir()
    with pytest.raises(SystemExit) as exc:
        main(["sim", *SIM_ARGS, "--plot", str(png)])
    assert exc.value.code == 2
    assert f"--plot {png}: cannot write there" in capsys.readouterr().err


def test_sim_json_is_written_before_a_plot_that_fails(capsys, tmp_path, monkeypatch):
    from tiered_kv.sim import plot as plot_mod

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plot_mod, "plot", broken)
    path = tmp_path / "sim.json"
    with pytest.raises(OSError, match="No space left"):
        main(
            [
                "sim",
                *SIM_ARGS,
                "--policies",
                "lru",
                "--json",
                str(path),
                "--plot",
                str(tmp_path / "p.png"),
            ]
        )
    assert json.loads(path.read_text())["rows"]


def test_sim_log_capacity_plot_with_storage(capsys, tmp_path):
    png = tmp_path / "log.png"
    argv = ["sim", *SIM_ARGS, "--storage", "0.5", "--write-policy", "write_back"]
    assert main([*argv, "--log-capacity", "--jobs", "1", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- bench ----------------------------------------------------------------------------------------
def test_bench_json_matches_readme_and_the_table(capsys, tmp_path):
    path = tmp_path / "bench.json"
    assert main(["bench", *BENCH_ARGS, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    res = json.loads(path.read_text())
    _check_documented_keys("bench", res)
    assert res["command"] == "bench" and res["device"] == "cpu"
    rows = res["device_host"]
    assert sorted((r["layout"], r["io_backend"], r["page_size"]) for r in rows) == sorted(
        (lay, io_, p)
        for lay in ("page_first", "layer_first")
        for io_ in ("kernel", "direct")
        for p in (8, 16)
    )
    mib = 64 * 2 * 2 * 16 * 2 / 2**20  # tokens x layers x (K, V) x head_dim x fp16
    for r in rows:
        assert r["pinned"] is False  # no CUDA: pageable host memory
        assert r["mib"] == pytest.approx(mib)
        assert r["baseline_gbps"] > 0
        for k in ("backup", "load_layerwise", "load_all"):
            assert r[f"{k}_gbps"] > 0
            assert r[f"{k}_ratio"] == pytest.approx(r[f"{k}_gbps"] / r["baseline_gbps"])
    s = res["host_storage"]
    assert s["pages"] == 64 // 16  # the largest page size
    assert s["page_mib"] == pytest.approx(16 * 2 * 2 * 16 * 2 / 2**20)
    assert s["mib"] == pytest.approx(s["pages"] * s["page_mib"])
    assert s["set_gbps"] > 0 and s["warm_get_gbps"] > 0

    lines = out.splitlines()
    for r in rows:
        assert any(
            re.match(rf"^{r['layout']}\s+{r['io_backend']}\s+{r['page_size']}\s+False\s", line)
            for line in lines
        ), r
    assert re.search(rf"^page_first\s+{s['pages']}\s", out, flags=re.M)


def test_bench_no_storage_drops_only_host_storage(capsys, tmp_path):
    path = tmp_path / "bench.json"
    argv = [*BENCH_ARGS, "--page-sizes", "16", "--layouts", "page_first", "--io-backends", "direct"]
    assert main(["bench", *argv, "--no-storage", "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    _check_documented_keys("bench", res, skip=frozenset({"host_storage"}))
    assert len(res["device_host"]) == 1
    assert "host <-> storage" not in capsys.readouterr().out


def test_sim_host_policy_applies_to_the_host_tier_only(tmp_path, capsys):
    from tiered_kv.cli.main import main

    out = tmp_path / "sim.json"
    argv = [
        "sim",
        "--users",
        "3",
        "--rounds",
        "2",
        "--shared-prompt",
        "64",
        "--history",
        "0",
        "--answer",
        "16",
        "--capacities",
        "0.3",
        "--policies",
        "lru,s3fifo",
        "--host-policy",
        "fifo",
        "--write-policy",
        "write_back",
        "--no-progress",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["policy"], r["host_policy"]) for r in rows] == [("lru", "fifo"), ("s3fifo", "fifo")]
    assert "lru / host fifo" in capsys.readouterr().out
    same = tmp_path / "same.json"
    i = argv.index("--host-policy")
    assert main([*argv[:i], *argv[i + 2 : -1], str(same)]) == 0
    assert [r["host_policy"] for r in json.loads(same.read_text())["rows"]] == ["lru", "s3fifo"]


@pytest.mark.parametrize("attention", ["mla", "dsa", "swa", "hybrid-linear"])
def test_run_reference_with_each_attention_kind_verifies_bitwise(tmp_path, attention):
    store = str(tmp_path / attention)
    code, res, printed = _run(["--store", store, "--attention", attention])
    assert code == 0
    assert res["config"]["attention"] == attention
    v = res["verification"]
    assert v["passed"] is True and v["bitwise"] == v["requests"] == res["requests"]
    assert sum(res["hits"].values()) == res["prompt_tokens"]
    assert res["hits"]["device"] > 0
    assert "PASS" in printed
    if attention != "mla":  # a second run over the same store restores from storage
        code, again, _ = _run(["--store", store, "--attention", attention])
        assert code == 0 and again["hits"]["storage"] > 0
        assert again["verification"]["passed"] is True
