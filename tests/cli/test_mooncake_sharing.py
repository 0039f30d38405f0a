"""Two serving processes share one Mooncake master (issue 17): each run-reference is its own
process with its own device, host and local store (``--storage-local-copy``), as two machines
would be; the prefixes the first computed are storage hits for the second, and every logit of
both still equals the no-cache run's, bit for bit. The store's memory is lent by this test
process (``segment_bytes`` 0 in the runs): a node's lent memory goes when it exits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.cli.test_cli_json import RUN_ARGS
from tests.storage.mooncake_server import MooncakeServer

ROOT = Path(__file__).resolve().parents[2]


def _run_process(args: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "tiered_kv.cli.main", "run-reference", *RUN_ARGS, *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [*cmd, "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def test_two_processes_share_one_mooncake_master(tmp_path):
    server = MooncakeServer()
    try:
        options = json.dumps({**server.options, "segment_bytes": 0})
        remote = ["--storage-backend", "mooncake", "--storage-options", options]
        remote.append("--storage-local-copy")
        first = _run_process(["--store", str(tmp_path / "node-a"), *remote], tmp_path / "a.json")
        second = _run_process(["--store", str(tmp_path / "node-b"), *remote], tmp_path / "b.json")
    finally:
        server.close()
    for res in (first, second):
        assert res["verification"]["passed"] is True
        assert res["verification"]["bitwise"] == res["verification"]["requests"] > 0
        assert res["storage"]["errors"] == 0 and res["storage"]["checksum_failures"] == 0
        assert res["transfers"]["host_to_storage"]["bytes"] > 0
    # The second node's own local store started empty: its first request's storage hits are
    # pages the first node computed, read from the shared store.
    assert first["per_request"][0]["storage"] == 0
    assert second["per_request"][0]["storage"] > 0
    assert second["hits"]["storage"] > first["hits"]["storage"]
    assert second["transfers"]["storage_to_host"]["bytes"] > 0
    assert (tmp_path / "node-a").is_dir() and (tmp_path / "node-b").is_dir()
