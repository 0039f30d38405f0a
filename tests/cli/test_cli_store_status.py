"""Issue 30: the storage tier in a run's messages. A remote store that cannot be reached at the
start exits 2 naming the flag and the URL, unless ``--storage-optional`` (then the run serves
and its summary says why the store was off); a remote store's run prints no directory it does
not use; pages refused by checksum and a store turned off show in the text summary, not only
in the JSON."""

from __future__ import annotations

import json

from tests.cli.cli_process import TINY_RUN, assert_refused, tiered_kv
from tests.cli.test_cli_json import RUN_ARGS
from tiered_kv.cli.store_status import StoreWatch, problem_lines

# Port 1 on loopback: nothing listens there, a connection is refused at once.
UNREACHABLE = [
    "--storage-backend",
    "redis",
    "--storage-options",
    '{"url": "redis://127.0.0.1:1/0"}',
]


def test_unreachable_remote_store_is_refused_before_the_run(tmp_path):
    done = tiered_kv("run", *TINY_RUN, *UNREACHABLE, "--store-dir", str(tmp_path))
    line = assert_refused(done, "--storage-backend redis", "redis://127.0.0.1:1/0")
    assert "cannot be reached" in line and "--storage-optional" in line
    assert done.stdout == "" and list(tmp_path.iterdir()) == []


def test_storage_optional_serves_without_the_store_and_says_why(tmp_path):
    store = tmp_path / "unused"
    args = [*RUN_ARGS, "--no-verify", *UNREACHABLE, "--storage-optional", "--store", str(store)]
    out = tmp_path / "out.json"
    done = tiered_kv("run-reference", *args, "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    said = [line for line in done.stdout.splitlines() if line.startswith("storage:")]
    assert said and "redis://127.0.0.1:1/0 could not be reached" in said[0], done.stdout
    assert "--storage-optional" in said[0]
    # The remote store's run names the backend, not a directory it never creates.
    assert str(store) not in done.stdout and not store.exists()
    assert "store redis" in done.stdout
    assert json.loads(out.read_text())["hits"]["storage"] == 0


def test_pages_refused_by_checksum_show_in_the_summary(tmp_path):
    """A damaged slab file: its pages fail their checksum on the next run, which says so."""
    store = tmp_path / "store"
    base = ["run-reference", *RUN_ARGS, "--store", str(store), "--storage-layout", "slab"]
    first = tiered_kv(*base, "--no-verify")
    assert first.returncode == 0, first.stderr[-2000:]
    assert "refused by checksum" not in first.stdout
    (slab,) = (store / "slabs").iterdir()
    data = bytearray(slab.read_bytes())
    for i in range(0, len(data), 7):
        data[i] ^= 0xFF
    slab.write_bytes(bytes(data))
    out = tmp_path / "second.json"
    second = tiered_kv(*base, "--json", str(out))
    assert second.returncode == 0, second.stderr[-2000:]
    failures = json.loads(out.read_text())["storage"]["checksum_failures"]
    assert failures > 0
    assert f"storage: {failures} pages refused by checksum" in second.stdout
    assert "PASS" in second.stdout  # refused pages were computed again, never served


def test_problem_lines_name_each_trouble_and_nothing_when_all_went_well():
    clean = {"checksum_failures": 0, "errors": 0, "turned_off": 0, "skipped_while_off": 0}
    assert problem_lines(clean) == []
    lines = problem_lines(
        {**clean, "checksum_failures": 3, "errors": 9, "turned_off": 1, "skipped_while_off": 40},
        "tiered",
    )
    assert lines[0].startswith("storage (tiered): 3 pages refused by checksum")
    assert lines[1].startswith("storage (tiered): turned off 1 time(s) during the run")
    assert "40 calls answered as misses" in lines[1] and len(lines) == 2
    assert problem_lines({**clean, "errors": 2}) == [
        "storage: 2 errors (each a counted miss; the log says why)"
    ]


def test_store_watch_keeps_each_modes_counters_and_calls_the_hooks_it_wraps():
    class Cache:
        def __init__(self, failures: int) -> None:
            self.failures = failures

        def stats(self) -> dict:
            return {"storage": {"checksum_failures": self.failures}}

    seen = []
    watch = StoreWatch(
        {
            "on_cache": lambda mode, cache: seen.append(("cache", mode)),
            "on_mode_done": lambda mode, report: seen.append(("done", mode, report)),
            "on_progress": print,
        }
    )
    hooks = watch.hooks
    assert hooks["on_progress"] is print
    hooks["on_cache"]("tiered", Cache(2))
    hooks["on_mode_done"]("tiered", {"r": 1})
    hooks["on_cache"]("recompute", Cache(0))
    hooks["on_mode_done"]("recompute", {"r": 2})
    assert watch.storage == {
        "tiered": {"checksum_failures": 2},
        "recompute": {"checksum_failures": 0},
    }
    assert seen == [
        ("cache", "tiered"),
        ("done", "tiered", {"r": 1}),
        ("cache", "recompute"),
        ("done", "recompute", {"r": 2}),
    ]
    assert watch._caches == {}  # let go of each cache when its mode ended
