"""Checks a command makes before any work: an output file, an input trace, a store directory, a
port, the memory a run will allocate. Each refuses what would fail later with one line on stderr
naming the flag, the value and what would work, and exit status 2 (argparse's), so a run that
would fail at its end fails at once and leaves nothing behind (no folder created, no file
half-written).

A check that needs the filesystem tries it for real (a temporary folder made and removed) rather
than trusting permission bits, which say nothing for root or a read-only mount.
"""

from __future__ import annotations

import codecs
import os
import socket
import sys
import tempfile
from collections.abc import Sequence
from typing import NoReturn

GIB = 1 << 30


def fail(command: str, message: str) -> NoReturn:
    """One line on stderr, ``tiered-kv <command>: error: <message>``, and exit status 2."""
    print(f"tiered-kv {command}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _cannot_write(folder: str) -> str | None:
    """Why nothing can be created in ``folder`` (None: something can)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".tiered-kv-check-", dir=folder))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def check_output_file(command: str, flag: str, path: str | None) -> None:
    """``path`` can be written at the end (atomically, beside it): not a directory, in an
    existing directory this process can write in. None: nothing to check."""
    if not path:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        fail(command, f"{flag} {path}: is a directory; name a file (e.g. {path}/out.json)")
    if not os.path.isdir(parent):
        fail(command, f"{flag} {path}: {parent} is not a directory; create it first")
    why = _cannot_write(parent)
    if why:
        fail(command, f"{flag} {path}: cannot write in {parent} ({why}); name a writable directory")


def check_trace_file(command: str, flag: str, path: str, head: int = 1 << 16) -> None:
    """``path`` is a file this process can read whose first ``head`` bytes are UTF-8 text (a
    JSONL trace; not a binary or gzip-compressed file). The rest is checked as it is read: the
    trace readers refuse a line that is not UTF-8 with a ``TieredKVError`` naming it."""
    from tiered_kv.sim.traces import not_utf8

    try:
        with open(path, "rb") as f:
            data = f.read(head)
    except OSError as exc:
        fail(command, f"{flag} {path}: {exc.strerror or exc}")
    try:
        # final=False: a character cut at the end of `data` is not an error.
        codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
    except UnicodeDecodeError as exc:
        fail(command, f"{flag} {path}: {not_utf8(data, exc.start)}")


def check_store_dir(
    command: str, flag: str, path: str, *, create: bool = False, parents: bool = False
) -> None:
    """``path`` is a directory this process can write in; or, with ``create``, a missing one
    whose parent is (``parents``: whose nearest existing ancestor is), created later by the
    store. Nothing is created here."""
    where = path
    if os.path.exists(path) and not os.path.isdir(path):
        fail(command, f"{flag} {path}: is a file, not a directory; name a directory")
    if not os.path.exists(path):
        if not create:
            fail(command, f"{flag} {path}: no such directory; create it or leave {flag} out")
        where = os.path.dirname(os.path.abspath(path))
        while parents and not os.path.exists(where):
            where = os.path.dirname(where)
        if not os.path.isdir(where):
            fail(
                command,
                f"{flag} {path}: {where} is not a directory; name a directory whose parent exists "
                "(the store directory itself is created)",
            )
    why = _cannot_write(where)
    if why:
        fail(command, f"{flag} {path}: cannot write in {where} ({why}); name a writable directory")


def check_port_free(command: str, host: str, port: int) -> None:
    """``host:port`` can be listened on now (port 0: no endpoint, nothing to check). The bind
    is tried with ``SO_REUSEADDR``, as the HTTP server sets it: only a listener refuses it."""
    if not port:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        fail(command, f"--metrics-host {host}: not an address here ({exc.strerror})")
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            fail(
                command,
                f"--metrics-port {port}: cannot listen on {host}:{port} ({exc.strerror}); "
                "name a free port (or 0: no endpoint)",
            )


def check_fits(
    command: str, what: str, parts: Sequence[tuple[str, int]], free: int, where: str, fix: str
) -> None:
    """Refuse a run whose ``parts`` ((label, bytes), summed) exceed ``free`` bytes of
    ``where``: ``what`` is the flag and value the message starts with, ``fix`` what to lower."""
    need = sum(n for _, n in parts)
    if need <= free:
        return
    detail = " + ".join(f"{label} {n / GIB:.2f} GiB" for label, n in parts)
    fail(
        command,
        f"{what}: needs {need / GIB:.2f} GiB ({detail}) but {where} has {free / GIB:.2f} GiB "
        f"available; lower {fix}",
    )


def check_run_fits(cfg) -> None:
    """Refuse a scale run (``ScaleConfig``) whose tiered mode's pools do not fit in RAM (the
    scale run's device pool is on the CPU): the device pool (``sizes``' device bytes), the host
    pool (host tokens x the bytes per token of every layer that keeps KV, its exact size) and
    the memory host pools leave to the rest. The modes run one after another, each freeing its
    pools: the tiered mode's are the most."""
    import psutil

    from tiered_kv.engine.scale_workload import sizes
    from tiered_kv.host.memory import default_reserve_bytes

    s = sizes(cfg)
    parts = [
        ("device pool", s.device_bytes),
        ("host pool", s.host_tokens * s.bytes_per_token),
        ("left free by host pools", default_reserve_bytes()),
    ]
    check_fits(
        "run",
        f"--scale {cfg.scale:g} with --preset {cfg.model_preset.name}",
        parts,
        psutil.virtual_memory().available,
        "this machine",
        "--scale (or --users, --docs, --rounds, the --*-tokens lengths, --device-fraction, "
        "--host-fraction)",
    )
