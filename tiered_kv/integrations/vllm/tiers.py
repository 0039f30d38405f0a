"""The tiers behind one vLLM engine's connector: the host tier and the store, loads and saves.

``ConnectorTiers`` owns one rank's ``HostPages`` (with its ``HostSlots``) and its store (the
backend the settings name, behind a ``GuardedStorage``: every value's checksum and key checked on
read, storage trouble a counted miss). Pages are keyed by tiered_kv's chain digests over vLLM's
block tokens (``storage.keys``), under a namespace of the model identity, the block geometry and
layout, the dtype and the rank.

- ``lookup``: how many leading pages of a chain the host tier or the store holds (a read).
- ``load``: pages onto vLLM's blocks: host hits pinned, the rest fetched from the store into
  host slots first, then copied host -> blocks one layer at a time (``on_layer`` after each).
  Whatever cannot be proven to be the page written (a store miss, a damaged value, no host slot
  to fetch into, a failed copy) fails that block and every later one of the chain: the caller
  reports them to vLLM, which recomputes them. Nothing raises for storage trouble.
- ``begin_save`` / ``SaveCopy``: blocks -> host slots, layer by layer inside the forward;
  ``finish_save`` names the slots (a load may use them at once) and writes them to the store on
  the save thread; the slots stay pinned until the store answers.

Every counter is in ``counters`` (``TierCounters``), read by the connector's stats.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from tiered_kv import gil_switch
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.integrations.vllm.block_layout import BlockLayout
from tiered_kv.integrations.vllm.host_pages import HostPages
from tiered_kv.integrations.vllm.host_slots import HostSlots
from tiered_kv.integrations.vllm.settings import FLAG, ConnectorSettings
from tiered_kv.kernels.row_job import copy_threads_setting, run_beside_compute
from tiered_kv.log_limit import LogLimiter
from tiered_kv.storage.backends import open_backend
from tiered_kv.storage.guarded_store import GuardedStorage
from tiered_kv.storage.keys import StorageNamespace, page_keys_of

log = logging.getLogger("vllm.tiered_kv.tiers")  # inside vLLM, its handler (see connector.py)
_LOG = LogLimiter(log)


def _us(since: float) -> int:
    return int((time.perf_counter() - since) * 1e6)


class TierCounters:
    """Thread-safe event counts (blocks unless named otherwise), since the tiers opened."""

    NAMES = (
        "lookups", "lookup_hit_blocks", "loaded_host_blocks", "loaded_store_blocks",
        "load_failed_blocks", "load_no_slot_blocks", "saved_blocks", "save_skipped_blocks",
        "save_dropped_blocks",
        "save_present_blocks", "store_written_blocks", "store_write_failed_blocks",
        "copy_errors", "loaded_bytes", "saved_bytes",
        "store_read_us", "load_copy_us", "save_copy_us", "store_write_us",
        "loaded_window_blocks", "loaded_state_blocks", "saved_state_blocks",
        "window_skipped_blocks", "failed_load_requests",
    )  # fmt: skip

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.NAMES, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                self._counts[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


@dataclass
class SaveCopy:
    """One step's blocks being copied to host slots, layer by layer (``slots[i]`` for
    ``blocks[i]``; blocks whose page the host already caches or that got no slot are left out)."""

    blocks: list[int]
    digests: list[bytes]
    slots: list[int]
    plan: tuple
    layers_done: set[int] = field(default_factory=set)
    failed: bool = False  # a layer's copy failed: nothing of this save is named


class ConnectorTiers:
    """One rank's host tier and store for ``layout``'s pages."""

    def __init__(
        self,
        settings: ConnectorSettings,
        layout: BlockLayout,
        rank: str | None,
        kv_cache_dtype: str | None = None,
        num_slots: int | None = None,
    ) -> None:
        s = settings.storage
        self.layout = layout
        self.namespace: StorageNamespace = layout.namespace(
            model=settings.model_id,
            rank=rank,
            tenant=s.namespace_salt,
            kv_scales=s.kv_scales_id,
            kv_cache_dtype=kv_cache_dtype,
        )
        self.namespace.check_complete()  # fail closed, before anything is allocated
        if num_slots is None:  # a share of host_bytes where several groups split it
            num_slots = settings.host_bytes // layout.page_nbytes
        if num_slots < 1:
            raise InvalidArgumentError(
                f"{FLAG}.host_bytes={settings.host_bytes} holds no page: a page (one block of "
                f"{len(layout.layer_ids)} layers) is {layout.page_nbytes} bytes; give at least that"
            )
        copy_threads_setting()  # a bad TIERED_KV_COPY_THREADS is refused at start-up
        self.pages = HostPages(layout, num_slots)
        self.slots = HostSlots(num_slots)
        opener = functools.partial(
            open_backend, s, s.storage_path, self.namespace, layout.page_nbytes
        )
        self.store = GuardedStorage(opener)
        self.counters = TierCounters()
        kind = layout.kind.removeprefix("vllm-")
        self._kinds = (kind,) if kind in ("window", "state") else ()  # counted on their own
        # Both threads copy while the model computes: their copies take only free cores.
        self._loader = ThreadPoolExecutor(
            1, thread_name_prefix="tiered-kv-vllm-load", initializer=run_beside_compute
        )
        self._saver = ThreadPoolExecutor(
            1, thread_name_prefix="tiered-kv-vllm-save", initializer=run_beside_compute
        )
        # The load and save threads release the GIL at every system call and copy; the engine's
        # main thread would keep it for a whole switch interval at each (settings.py).
        us = settings.gil_switch_us
        self._gil = gil_switch.shorten(us / 1e6) if us else None
        self._closed = False

    def keys(self, digests: Sequence[bytes]) -> list[bytes]:
        return page_keys_of(self.namespace, digests)

    # -- reads ------------------------------------------------------------------------------
    def lookup(self, digests: Sequence[bytes]) -> tuple[int, int]:
        """How many of ``digests`` from the start the host tier holds, and how many after those
        the store holds, now (a later load may still miss: the load reports it)."""
        on_host = self.slots.lookup(digests)
        rest = digests[on_host:]
        in_store = self.store.batch_exists(self.keys(rest)) if rest else 0
        self.counters.add(lookups=1, lookup_hit_blocks=on_host + in_store)
        return on_host, in_store

    # -- loads ------------------------------------------------------------------------------
    def submit_load(self, blocks, digests, on_layer: Callable[[int], None] | None = None):
        """``load`` on the load thread; a Future of the failed blocks."""
        return self._loader.submit(self.load, list(blocks), list(digests), on_layer)

    def submit(self, fn: Callable[[], set[int]]) -> Future:
        """``fn`` (loads of its own) on the load thread, after the loads submitted before."""
        return self._loader.submit(fn)

    def load(
        self,
        blocks: Sequence[int],
        digests: Sequence[bytes],
        on_layer: Callable[[int], None] | None = None,
    ) -> set[int]:
        """Fill ``blocks[i]`` with page ``digests[i]``; the blocks not filled (a chain's first
        failure and every block after it). ``on_layer(l)`` runs after layer position ``l`` is
        in place (every layer is announced, also when nothing could be loaded)."""
        pinned: list[int] = []
        ok = fetched = 0
        try:
            ok, pinned, fetched = self._to_host(list(digests))
            good = list(blocks[:ok])
            try:
                plan = self.pages.plan(good, pinned[:ok])
                for layer in range(len(self.layout.layer_ids)):
                    start = time.perf_counter()
                    self.pages.copy(plan, to_host=False, layers=[layer])
                    self.counters.add(load_copy_us=_us(start))
                    if on_layer is not None:
                        on_layer(layer)
            except Exception as exc:  # noqa: BLE001 - a failed copy is a miss, never a crash
                self.counters.add(copy_errors=1)
                _LOG.log(logging.WARNING, "load-copy", "host -> block copy failed: %r", exc)
                ok = fetched = 0
            self.counters.add(
                loaded_bytes=ok * self.layout.page_nbytes,
                loaded_host_blocks=ok - fetched,
                loaded_store_blocks=fetched,
                **{f"loaded_{k}_blocks": ok for k in self._kinds},
            )
        finally:
            for slot in pinned:
                self.slots.unpin(slot)
            if on_layer is not None:  # a waiter never hangs on a layer that will not come
                for layer in range(len(self.layout.layer_ids)):
                    on_layer(layer)
        failed = set(blocks[ok:])
        self.counters.add(load_failed_blocks=len(failed))
        return failed

    def _to_host(self, digests: list[bytes]) -> tuple[int, list[int], int]:
        """Pin a host slot holding each page, fetching misses from the store: (how many from
        the start are on the host now, the pinned slots in chain order, how many of those
        leading pages came from the store)."""
        slots: list[int | None] = [self.slots.pin_cached(d) for d in digests]
        fetch = [i for i, s in enumerate(slots) if s is None]
        staged: list[int] = []
        for _ in fetch:
            slot = self.slots.take()
            if slot is None:
                self.counters.add(load_no_slot_blocks=len(fetch) - len(staged))
                break
            staged.append(slot)
        fetch = fetch[: len(staged)]
        start = time.perf_counter()
        served = (
            self.store.batch_get(self.keys([digests[i] for i in fetch]), self.pages, staged)
            if fetch
            else []
        )
        self.counters.add(store_read_us=_us(start))
        for i, slot, good in zip(fetch, staged, served, strict=True):
            if good:
                self.slots.publish(slot, digests[i])
                slots[i] = slot
            else:
                self.slots.unpin(slot)
        ok = 0
        while ok < len(slots) and slots[ok] is not None:
            ok += 1
        fetched = sum(1 for i in fetch if i < ok)
        return ok, [s for s in slots if s is not None], fetched

    # -- saves ------------------------------------------------------------------------------
    def begin_save(self, blocks: Sequence[int], digests: Sequence[bytes]) -> SaveCopy:
        """Host slots for the pages of ``blocks`` not cached on the host yet (pinned). A page
        several requests of one step computed (a shared prefix first seen together) is copied
        and written once."""
        keep_b, keep_d, slots = [], [], []
        present = skipped = 0
        taken: set[bytes] = set()
        for b, d in zip(blocks, digests, strict=True):
            if d in taken or self.slots.lookup([d]):
                present += 1
                continue
            slot = self.slots.take()
            if slot is None:
                skipped += 1
                continue
            taken.add(d)
            keep_b.append(b)
            keep_d.append(d)
            slots.append(slot)
        self.counters.add(save_present_blocks=present, save_skipped_blocks=skipped)
        return SaveCopy(keep_b, keep_d, slots, self.pages.plan(keep_b, slots))

    def copy_layer(self, save: SaveCopy, layer: int) -> None:
        """Blocks -> host slots for one layer position (once per layer). A failed copy fails
        the whole save (``finish_save`` frees its slots) and never raises: this runs inside
        vLLM's forward (``save_kv_layer``), where a lost save must not cost the step."""
        if layer not in save.layers_done and save.blocks and not save.failed:
            start = time.perf_counter()
            try:
                self.pages.copy(save.plan, to_host=True, layers=[layer])
            except Exception as exc:  # noqa: BLE001 - a failed save is a future miss
                save.failed = True
                self.counters.add(copy_errors=1)
                _LOG.log(logging.WARNING, "save-copy", "block -> host copy failed: %r", exc)
            self.counters.add(save_copy_us=_us(start))
        save.layers_done.add(layer)

    def drop_save(self, save: SaveCopy) -> None:
        """Give back a save's host slots unnamed: its blocks' KV cannot be trusted."""
        for slot in save.slots:
            self.slots.unpin(slot)
        self.counters.add(save_dropped_blocks=len(save.blocks))
        save.slots, save.blocks, save.digests = [], [], []

    def finish_save(self, save: SaveCopy) -> Future | None:
        """Copy the layers not copied yet, name the slots, and write them to the store on the
        save thread (the slots are unpinned when it answers). A failed copy frees the slots:
        nothing half-copied is ever named."""
        if not save.blocks:
            return None
        for layer in range(len(self.layout.layer_ids)):
            self.copy_layer(save, layer)
        if save.failed:
            for slot in save.slots:
                self.slots.unpin(slot)
            return None
        for slot, d in zip(save.slots, save.digests, strict=True):
            self.slots.publish(slot, d)
        n = len(save.blocks)
        state = {"saved_state_blocks": n} if "state" in self._kinds else {}
        self.counters.add(saved_blocks=n, saved_bytes=n * self.layout.page_nbytes, **state)
        return self._saver.submit(self._write, save)

    def _write(self, save: SaveCopy) -> None:
        try:
            start = time.perf_counter()
            stored = self.store.batch_set(self.keys(save.digests), self.pages, save.slots)
            self.counters.add(store_write_us=_us(start))
            n = sum(stored)
            self.counters.add(store_written_blocks=n, store_write_failed_blocks=len(stored) - n)
        finally:
            for slot in save.slots:
                self.slots.unpin(slot)

    # -- lifetime ---------------------------------------------------------------------------
    def drain(self) -> None:
        """Wait for every load and store write submitted so far."""
        for pool in (self._loader, self._saver):
            pool.submit(lambda: None).result()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loader.shutdown(wait=True)
        self._saver.shutdown(wait=True)
        self.store.close()
        self.pages.destroy()
        if self._gil is not None:
            self._gil.close()
