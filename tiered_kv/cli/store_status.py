"""The storage tier as a command tells it: a remote store probed before the run
(``check_remote_store``: exit 2 when it cannot be reached, unless ``--storage-optional``), its
counters kept per mode of a scale run (``StoreWatch``), and the summary's lines for what went
wrong (``problem_lines``: pages refused by checksum, a store turned off, errors).

A remote store that does not answer is not an error to the cache: every call is a counted miss
and the store is turned off (``GuardedStorage``). A run over it would finish with status 0 and
no storage hits, so the command asks first.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import re
from collections.abc import Iterator, Mapping
from typing import NamedTuple

from tiered_kv.cli.preflight import fail
from tiered_kv.errors import InvalidArgumentError, StorageOpenError
from tiered_kv.storage_config import is_embedded


class Probe(NamedTuple):
    where: str  # the server, as the store names it (a password left out)
    why: str | None  # why it cannot be used (None: it answered)
    opened: bool  # whether the store could be opened at all (a lazy client opens unanswered)


def probe(cls: type, options: Mapping[str, object] | None) -> Probe:
    """Open a store of class ``cls`` (a remote backend's) with ``options`` and look one key up.
    Options it refuses raise ``StorageOpenError`` / ``InvalidArgumentError``: no server coming
    up makes those work."""
    from tiered_kv.storage.keys import StorageNamespace

    ns = StorageNamespace.create(
        kind="bytes", parts=[("raw", [64])], dtype="uint8", layer_ids=[0], page_size=1,
        layout="page_first", model="tiered-kv-probe",
    )  # fmt: skip
    with _quiet():  # the probe's misses are the answer, not log records
        return _look_up(cls, ns, options)


def _look_up(cls: type, ns, options: Mapping[str, object] | None) -> Probe:
    from tiered_kv.storage.keys import page_keys_of

    try:
        store = cls(ns, 64, budget_bytes=None, **dict(options or {}))
    except TypeError as exc:  # an option the backend does not take
        raise StorageOpenError(f"{cls.__name__} refused them: {exc}") from None
    except InvalidArgumentError:
        raise
    except Exception as exc:  # noqa: BLE001 - a client that cannot connect, in its own words
        named = dict(options or {})
        where = named.get("url") or named.get("master") or f"{cls.__name__}'s default"
        return Probe(_redacted(str(where)), _redacted(f"{type(exc).__name__}: {exc}"), False)
    where = _redacted(str(getattr(store, "url", None) or getattr(store, "master", None) or ""))
    try:
        store.batch_exists(page_keys_of(ns, [hashlib.sha256(b"tiered-kv probe").digest()]))
        errors = store.stats().errors
    except Exception as exc:  # noqa: BLE001
        return Probe(where, _redacted(f"{type(exc).__name__}: {exc}"), True)
    finally:
        with contextlib.suppress(Exception):
            store.close()
    return Probe(where or cls.__name__, ", ".join(sorted(errors)) or None, True)


@contextlib.contextmanager
def _quiet(name: str = "tiered_kv.storage") -> Iterator[None]:
    """The package's storage loggers silent for the ``with`` block (a rate-limited log counts
    nothing it does not emit, so the run's own first errors are still logged)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def _redacted(text: str) -> str:
    """``text`` without the password of a URL in it (``redis://user:secret@host``)."""
    return re.sub(r"(://[^:/@\s]*:)[^@\s]+@", r"\1***@", text)


def check_remote_store(command: str, args: argparse.Namespace) -> str | None:
    """Before any work: a backend that cannot be loaded or refuses ``--storage-options`` exits
    2; so does a remote store that cannot be reached, unless ``--storage-optional``: then the
    reason, for the summary (the run goes on, every lookup a miss until the store answers).
    None: an embedded store, or one that answered."""
    backend = args.storage_backend
    if is_embedded(backend):
        return None
    from tiered_kv.storage.backends import backend_class

    try:
        cls = backend_class(backend)
    except StorageOpenError as exc:
        fail(command, f"--storage-backend {backend}: {exc}")
    try:
        where, why, opened = probe(cls, args.storage_options)
    except (StorageOpenError, InvalidArgumentError) as exc:
        fail(command, f"--storage-options {json.dumps(args.storage_options)}: {exc}")
    if why is None:
        return None
    named = set(args.storage_options or {})
    default = "" if {"url", "master"} & named else " (no url in --storage-options: the default)"
    head = f"--storage-backend {backend}: the store at {where}{default} cannot be reached ({why})"
    if not opened:  # the cache could not open it either: nothing to serve around
        why_not = "its client does not open without it: --storage-optional cannot serve around it"
        fail(command, f"{head}; start it or fix --storage-options ({why_not})")
    if not args.storage_optional:
        fail(command, f"{head}; start it or fix --storage-options, or give --storage-optional")
    return (
        f"the store at {where}{default} could not be reached at the start ({why}); serving "
        "went on without it (--storage-optional)"
    )


def problem_lines(storage: Mapping[str, int], label: str = "") -> list[str]:
    """What the summary says of a store's counters (``cache.stats()["storage"]``): nothing when
    all went well. ``label``: whose store (a mode of the scale run)."""
    head = f"storage{f' ({label})' if label else ''}:"
    out = []
    if storage.get("checksum_failures"):
        out.append(
            f"{head} {storage['checksum_failures']} pages refused by checksum (damaged or "
            "foreign values: served as misses and computed again)"
        )
    if storage.get("turned_off"):
        out.append(
            f"{head} turned off {storage['turned_off']} time(s) during the run after failing "
            f"calls in a row ({storage.get('skipped_while_off', 0)} calls answered as misses "
            "while off; the log says why)"
        )
    elif storage.get("errors"):
        out.append(f"{head} {storage['errors']} errors (each a counted miss; the log says why)")
    return out


class StoreWatch:
    """Each mode's store counters (``storage``: mode -> ``cache.stats()["storage"]``), read from
    its cache when the mode ends: ``hooks`` are ``run_scale``'s ``on_cache`` and
    ``on_mode_done``, each calling the one of ``chained`` after (the run's observers)."""

    def __init__(self, chained: Mapping[str, object]) -> None:
        self._chained = dict(chained)
        self._caches: dict[str, object] = {}
        self.storage: dict[str, dict] = {}

    @property
    def hooks(self) -> dict:
        return {**self._chained, "on_cache": self._on_cache, "on_mode_done": self._on_mode_done}

    def _on_cache(self, mode: str, cache) -> None:
        self._caches[mode] = cache
        if self._chained.get("on_cache") is not None:
            self._chained["on_cache"](mode, cache)

    def _on_mode_done(self, mode: str, report: dict) -> None:
        cache = self._caches.pop(mode, None)  # let go of it: the next mode's pools come next
        if cache is not None:
            with contextlib.suppress(Exception):  # counters of a closed cache: its last ones
                self.storage[mode] = cache.stats()["storage"]
        if self._chained.get("on_mode_done") is not None:
            self._chained["on_mode_done"](mode, report)
