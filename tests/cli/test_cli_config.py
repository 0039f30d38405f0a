"""``--config FILE.toml``: keys mirror the flags (``-`` or ``_``, top level or under the
command's table), command-line flags win, and every problem with the file exits 2 naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiered_kv.cli import run_cmd
from tiered_kv.cli.main import main, parse


@pytest.fixture(autouse=True)
def _no_default_store(monkeypatch, tmp_path):
    """Never touch the default ~/.cache store, even if a check stops failing and
    `run-reference` runs."""
    monkeypatch.setattr(run_cmd, "default_cache_dir", lambda: tmp_path / "cache")


def _toml(tmp_path: Path, text: str, name: str = "cfg.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _fail(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, (argv, info.value.code, err)
    return err


def test_dash_and_underscore_keys_at_top_level(tmp_path):
    cfg = _toml(
        tmp_path,
        'device-tokens = 2048\nhost_tokens = 4096\ndevice-policy = "fifo"\nseed = -3\n',
    )
    args = parse(["run-reference", "--config", cfg])
    assert args.device_tokens == 2048
    assert args.host_tokens == 4096
    assert args.device_policy == "fifo"
    assert args.seed == -3
    # Untouched flags keep their defaults.
    assert args.users == parse(["run-reference"]).users
    scale = _toml(tmp_path, "active-users = 2\nchunk_tokens = 256\ndisk-gbps = 3\n", "s.toml")
    args = parse(["run", "--config", scale])
    assert (args.active_users, args.chunk_tokens, args.disk_gbps) == (2, 256, 3.0)
    assert args.users == parse(["run"]).users


def test_keys_under_the_command_table_win_over_top_level(tmp_path):
    cfg = _toml(
        tmp_path,
        "users = 7\nrounds = 5\n"
        '[run-reference]\nusers = 9\nkv_heads = 1\nhost-layout = "layer_first"\n'
        # Other commands' tables are not read by `run-reference` (these keys would be unknown
        # to it), nor is [run-reference] by `run`.
        "[run]\nusers = 11\nactive-users = 3\ndocs = 2\n"
        '[sim]\ncapacities = "0.3"\n[bench]\npage-sizes = "8"\n',
    )
    args = parse(["run-reference", "--config", cfg])
    assert (args.users, args.rounds, args.kv_heads) == (9, 5, 1)
    assert args.host_layout == "layer_first"
    run = parse(["run", "--config", cfg])
    assert (run.users, run.rounds, run.active_users, run.docs) == (11, 5, 3, 2)
    sim = parse(["sim", "--config", cfg])
    assert sim.capacities == [0.3]
    assert (sim.users, sim.rounds) == (7, 5)
    # Top-level keys apply to every command: `users` is unknown to bench.
    with pytest.raises(SystemExit):
        parse(["bench", "--config", cfg, "--tokens", "64"])
    bench_only = _toml(tmp_path, '[run]\nusers = 2\n[bench]\npage-sizes = "8"\n', "b.toml")
    assert parse(["bench", "--config", bench_only, "--tokens", "64"]).page_sizes == [8]


def test_run_reference_table_is_read_with_dash_or_underscore(capsys, tmp_path):
    dash = _toml(tmp_path, "[run-reference]\nusers = 3\ndevice-tokens = 2048\n", "d.toml")
    args = parse(["run-reference", "--config", dash])
    assert (args.users, args.device_tokens) == (3, 2048)
    assert parse(["run", "--config", dash]).users == parse(["run"]).users  # not `run`'s table
    under = _toml(tmp_path, "[run_reference]\nusers = 4\nfresh = true\n", "u.toml")
    args = parse(["run-reference", "--config", under])
    assert (args.users, args.fresh) == (4, True)
    both = _toml(tmp_path, "[run-reference]\nusers = 3\n[run_reference]\nusers = 4\n", "b.toml")
    err = _fail(capsys, ["run-reference", "--config", both])
    assert "[run-reference] and [run_reference] are the same" in err


def test_command_line_flags_override_the_file(tmp_path):
    cfg = _toml(
        tmp_path,
        "[run-reference]\nusers = 5\npage-size = 32\ndevice-tokens = 4096\n"
        'write-policy = "write_back"\n',
    )
    argv = ["run-reference", "--config", cfg, "--users", "3", "--write-policy", "write_through"]
    args = parse(argv)
    assert args.users == 3
    assert args.write_policy == "write_through"
    assert (args.page_size, args.device_tokens) == (32, 4096)
    # Validation sees the merged values: the flag's page size against the file's device tokens.
    assert parse(["run-reference", "--config", cfg, "--page-size", "64"]).device_tokens == 4096


def test_booleans(tmp_path):
    cfg = _toml(tmp_path, "no-verify = true\nfresh = true\nno_progress = true\n")
    args = parse(["run-reference", "--config", cfg])
    assert args.no_verify is True and args.fresh is True and args.no_progress is True
    off = _toml(tmp_path, "[run-reference]\nfresh = false\nno-verify = false\n", "off.toml")
    args = parse(["run-reference", "--config", off])
    assert args.fresh is False and args.no_verify is False
    # A flag on the command line still switches it on.
    assert parse(["run-reference", "--config", off, "--fresh"]).fresh is True
    bench = parse(["bench", "--config", _toml(tmp_path, "[bench]\nno-storage = true\n", "b.toml")])
    assert bench.no_storage is True


def test_backend_options_as_a_toml_table(tmp_path, capsys):
    """``storage-options`` is a table in the file and one JSON object on the command line."""
    text = (
        '[run]\nstorage-backend = "redis"\nstorage-local-copy = true\n'
        'storage-options = { url = "redis://10.0.0.5:6379/1", timeout_s = 0.5 }\n'
    )
    cfg = _toml(tmp_path, text)
    args = parse(["run", "--config", cfg])
    assert args.storage_backend == "redis" and args.storage_local_copy is True
    assert args.storage_options == {"url": "redis://10.0.0.5:6379/1", "timeout_s": 0.5}
    flag = parse(["run", "--config", cfg, "--storage-options", '{"url": "redis://h:1/0"}'])
    assert flag.storage_options == {"url": "redis://h:1/0"}  # the flag wins
    assert parse(["run-reference", "--config", cfg]).storage_options is None  # [run] only
    top = _toml(tmp_path, '[storage-options]\nurl = "redis://h:2/0"\n[run]\nusers = 2\n', "o.toml")
    assert parse(["run-reference", "--config", top]).storage_options == {"url": "redis://h:2/0"}
    with pytest.raises(SystemExit):  # a table where a flag takes a plain value
        parse(["run", "--config", _toml(tmp_path, "[run]\nusers = { a = 1 }\n", "t.toml")])
    assert "expected a value like the flag's, not dict" in capsys.readouterr().err


def test_lists_for_comma_separated_flags(tmp_path):
    cfg = _toml(
        tmp_path,
        '[sim]\npolicies = ["lru", "fifo"]\ncapacities = [0.1, 0.5, 12]\n'
        '[bench]\npage-sizes = [8, 16]\nlayouts = ["page_first"]\ntokens = 64\n',
    )
    sim = parse(["sim", "--config", cfg])
    assert sim.policies == ["lru", "fifo"]
    assert sim.capacities == [0.1, 0.5, 12.0]
    bench = parse(["bench", "--config", cfg])
    assert bench.page_sizes == [8, 16]
    assert bench.layouts == ["page_first"]
    single = _toml(tmp_path, "page-sizes = 16\n", "p.toml")
    assert parse(["bench", "--config", single]).page_sizes == [16]


@pytest.mark.parametrize(
    ("command", "text", "expected"),
    [
        ("run-reference", "bogus = 1\n", ["unknown key 'bogus'", "valid keys", "device-tokens"]),
        ("run-reference", "[run-reference]\ndevice_token = 1024\n", ["unknown key 'device_token'"]),
        ("run-reference", 'config = "other.toml"\n', ["unknown key 'config'"]),
        ("run-reference", "help = true\n", ["unknown key 'help'"]),
        # A sim-only key at the top level is unknown to run.
        ("run-reference", 'capacities = "0.1"\n', ["unknown key 'capacities'"]),
        ("run-reference", "[runn]\nusers = 2\n", ["unknown table [runn]", "[run-reference]"]),
        ("run-reference", 'users = "abc"\n', ["users='abc'", "not an integer"]),
        ("run-reference", "users = 1.5\n", ["users=", "1.5", "not an integer"]),
        ("run-reference", "users = 0\n", ["users=", "must be >= 1"]),
        ("run-reference", "users = true\n", ["users=True"]),
        ("run-reference", "[run-reference]\nusers = {a = 1}\n", ["users="]),
        ("run-reference", "users = 2024-01-01\n", ["users="]),
        ("run-reference", 'fresh = "yes"\n', ["fresh='yes'", "true or false"]),
        ("run-reference", "no-verify = 1\n", ["no-verify=1", "true or false"]),
        ("run-reference", 'device-policy = "bogus"\n', ["device-policy='bogus'", "lru"]),
        ("run-reference", 'host_layout = "rows"\n', ["host_layout='rows'", "page_first"]),
        ("run-reference", "page-size = 12\n", ["--page-size 12", "power of two"]),
        ("run", "bogus = 1\n", ["unknown key 'bogus'", "valid keys", "active-users"]),
        ("run", "[run]\ndevice-tokens = 1024\n", ["unknown key 'device-tokens'"]),
        ("run", "[runn]\nusers = 2\n", ["unknown table [runn]", "[run]"]),
        ("run", "[serve-scale]\nusers = 2\n", ["unknown table [serve-scale]", "[run]"]),
        ("run", 'users = "abc"\n', ["users='abc'", "not an integer"]),
        ("run", "[run]\nscale = 0\n", ["scale=0", "must be in (0, 10000)"]),
        ("run", 'preset = "gpt-9"\n', ["preset='gpt-9'", "llama-3-8b"]),
        ("run", "fresh = true\n", ["unknown key 'fresh'"]),
        ("run", "chunk-tokens = 100\npage-size = 64\n", ["chunk_tokens=100"]),
        ("sim", 'capacities = "0,0.5"\n', ["capacities=", "'0'"]),
        ("sim", "capacities = [1.5]\n", ["capacities=", "'1.5'"]),
        ("sim", 'policies = ["lru", "mru"]\n', ["policies=", "mru"]),
        ("sim", 'host-ratio = "x"\n', ["host-ratio='x'"]),
        ("sim", 'plot = "hit.svg"\n', ["--plot hit.svg", ".png"]),
        ("sim", 'generator = "chat"\n', ["generator='chat'", "multi-round"]),
        ("bench", "page-sizes = [8, 12]\n", ["--page-sizes", "[12]"]),
        ("bench", 'dtype = "int8"\n', ["dtype='int8'", "float16"]),
    ],
)
def test_bad_files_exit_2_naming_the_problem(capsys, tmp_path, command, text, expected):
    cfg = _toml(tmp_path, text)
    progress = [] if command == "run" else ["--no-progress"]  # `run` prints no progress bar
    err = _fail(capsys, [command, *progress, "--config", cfg])
    assert f"tiered-kv {command}: error:" in err
    for part in expected:
        assert part in err, err


def test_missing_file_and_invalid_toml(capsys, tmp_path):
    missing = tmp_path / "nope.toml"
    err = _fail(capsys, ["sim", "--config", str(missing)])
    assert f"--config {missing}" in err and "No such file" in err
    bad = _toml(tmp_path, "users = \n[sim\n", "bad.toml")
    err = _fail(capsys, ["sim", "--config", bad])
    assert f"--config {bad}" in err and "not TOML" in err
    err = _fail(capsys, ["bench", "--config", str(tmp_path)])  # a directory
    assert f"--config {tmp_path}" in err


def test_config_drives_a_real_sim_run_and_flags_still_win(capsys, tmp_path):
    out = tmp_path / "out" / "sim.json"
    out.parent.mkdir()  # --json's folder must exist (checked before the run, issue 30)
    cfg = _toml(
        tmp_path,
        f'no-progress = true\njson = "{out}"\n'
        "[sim]\nusers = 3\nrounds = 2\nshared-prompt = 64\nhistory = 0\nanswer = 16\n"
        'block-size = 16\ncapacities = [0.2, 0.5]\npolicies = ["lru", "fifo"]\n'
        'write-policy = "write_back"\n',
    )
    assert main(["sim", "--config", cfg, "--capacities", "0.5", "--host-ratio", "2"]) == 0
    res = json.loads(out.read_text())
    assert res["write_policy"] == "write_back"
    assert res["inclusive_tiers"] is False
    assert res["host_ratio"] == 2.0
    assert res["requests"] == 6
    assert [(r["capacity"], r["policy"]) for r in res["rows"]] == [(0.5, "lru"), (0.5, "fifo")]
    for r in res["rows"]:
        assert r["host_blocks"] == 2 * r["device_blocks"]
    assert "write policy write_back" in capsys.readouterr().out


def test_config_drives_a_real_bench_run(tmp_path):
    out = tmp_path / "bench.json"
    cfg = _toml(
        tmp_path,
        "[bench]\nno-progress = true\nno-storage = true\ntokens = 32\nlayers = 1\n"
        'kv-heads = 1\nhead-dim = 8\npage-sizes = [16]\nlayouts = "page_first_direct"\n'
        'io-backends = ["direct"]\nrepeats = 1\ndtype = "float32"\n',
    )
    assert main(["bench", "--config", cfg, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert "host_storage" not in res
    assert [(r["layout"], r["io_backend"], r["page_size"]) for r in res["device_host"]] == [
        ("page_first_direct", "direct", 16)
    ]
    # 32 tokens x 1 layer x (K and V) x 1 head x 8 dims x 4 bytes
    assert res["device_host"][0]["mib"] == pytest.approx(32 * 2 * 8 * 4 / 2**20)
