"""Issue 27, sampled live verification: the fault campaign (``test_fault_campaign``) with
``verify_fraction=1.0`` and, beside its loud faults, corruption no checksum can see:

- a store whose ``batch_set`` stores other bytes than the host page's (changed before they are
  checksummed and written, so the stored value is self-consistent);
- a store whose ``batch_get`` answers a key with another key's intact value (a broken index
  above the value format: the value names the key it was asked for, so its key check passes);
- device <-> host copies that silently copy other rows of the job and report ok (through the
  host pool's copy methods, or the copy engine's jobs).

Before a request's first forward the campaign calls ``verify_restored``; the verifier is the
stand-in model's oracle. Every restored prefix that holds wrong KV at that point is counted
(``reached``); each must be caught (cut back to before its first wrong page: ``caught``), its
wrong pages must be gone at once from the tree (no match reaches them) and from the store, and
stay gone from the store (a restart included) until a request stores them again; and nothing
served after verification may differ from the model (``wrong == 0``). Integrity (every slot
accounted for) is checked after every quarantine and at every restart. Rerun a failure with
``TIERED_KV_CAMPAIGN_SEED=<printed seed>``.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import pytest
import torch

from tests.cache.test_fault_campaign import Campaign, Faults, campaign_seed, differs
from tiered_kv.errors import StateError
from tiered_kv.names import PrefetchPolicy, WritePolicy
from tiered_kv.storage.keys import page_digests, page_keys_of

OPS = int(os.environ.get("TIERED_KV_CAMPAIGN_OPS", 2500))
SILENT_RATE = 0.08


class CorruptedSource:
    """A host pool as a store reads it, with other bytes on the pages in ``bad`` (a copy: the
    host pool itself keeps its right bytes)."""

    def __init__(self, source, bad: dict[int, int]) -> None:
        self.source, self.bad = source, bad
        self.page_nbytes, self.num_pages = source.page_nbytes, source.num_pages

    def get_page_bytes(self, page: int) -> torch.Tensor:
        data = self.source.get_page_bytes(page)
        if page in self.bad:
            data = data.clone()
            data.view(-1)[self.bad[page] % len(data.view(-1))] ^= 0x5A
        return data

    def set_page_bytes(self, page: int, data) -> None:
        self.source.set_page_bytes(page, data)


class Silent:
    """The silent faults of one campaign (one seeded stream per point, as ``Faults``), the
    keys stored so far (what a swapped answer is drawn from) and the quarantined keys the
    store must not hold until they are stored again."""

    def __init__(self, seed: int) -> None:
        self.faults = Faults(seed ^ 0x51E47, SILENT_RATE)
        self.stored: list[bytes] = []
        self.absent: set[bytes] = set()
        self.lock = threading.Lock()  # a store write vs the checks of ``absent``

    def break_store(self, store) -> None:
        real_get, real_set = store.batch_get, store.batch_set

        def batch_set(keys, source, pages):
            bad = {}
            for page in pages:
                draw = self.faults.roll("set_corrupt")
                if draw is not None:
                    bad[int(page)] = int(draw * 1e9)
            with self.lock:
                self.absent.difference_update(bytes(k) for k in keys)
                done = real_set(keys, CorruptedSource(source, bad) if bad else source, pages)
            self.stored.extend(bytes(k) for k, ok in zip(keys, done, strict=False) if ok)
            return done

        def batch_get(keys, source, pages):
            keys = list(keys)
            for i in range(len(keys)):
                draw = self.faults.roll("get_swap")
                if draw is not None and len(self.stored) > 1:
                    other = self.stored[int(draw * len(self.stored)) % len(self.stored)]
                    if other != keys[i]:
                        keys[i] = other
            return real_get(keys, source, pages)

        store.batch_get, store.batch_set = batch_get, batch_set

    def break_copies(self, host, engine: bool) -> None:
        """Copies that copy other rows of their job and report ok: the host pool's copy
        methods, or with ``engine`` the copy engine's jobs (which run only while the methods
        are the pool's own)."""
        real_backup, real_load = host.backup_from_device_all_layer, host.load_to_device_per_layer
        real_job = getattr(host, "row_job", None)  # a host pool group has no engine path

        def backup(pool, host_indices, device_indices, io_backend="kernel"):
            if self.faults.roll("backup_rows") is not None:
                device_indices = device_indices.roll(1)
            real_backup(pool, host_indices, device_indices, io_backend)

        def load(pool, host_indices, device_indices, layer_id, io_backend="kernel"):
            if self.faults.roll("load_rows", SILENT_RATE / 3) is not None:  # per layer
                host_indices = host_indices.roll(1)
            real_load(pool, host_indices, device_indices, layer_id, io_backend)

        def row_job(pool, host_indices, device_indices, to_host, io_backend="kernel"):
            job = real_job(pool, host_indices, device_indices, to_host, io_backend)
            if job is None or self.faults.roll("engine_rows") is None:
                return job
            return dataclasses.replace(job, dev_rows=job.dev_rows.roll(1))

        if engine:
            host.row_job = row_job
        else:
            host.backup_from_device_all_layer, host.load_to_device_per_layer = backup, load


class VerifyCampaign(Campaign):
    def __init__(self, tmp_path, seed: int, write_policy: str, prefetch_policy: str, kind="mha"):
        self.silent = Silent(seed)
        super().__init__(tmp_path, seed, write_policy, prefetch_policy, kind, verify_fraction=1.0)
        for k in ("reached", "caught", "pre_verify_wrong", "extended_first", "no_room"):
            self.n[k] = 0
        self.pending: dict[int, list[int]] = {}  # id(request) -> its wrong pages (the oracle's)

    def _open(self):
        cache = super()._open()  # the campaign's loud faults first
        inner = getattr(cache.storage, "inner", None) or cache.storage
        self.silent.break_store(inner)
        self.silent.break_copies(cache.host_pool, self.engine)
        self.raw_exists = lambda keys, _s=inner: type(_s).batch_exists(_s, keys)
        cache.set_verifier(self.verifier)
        self.check_absent(cache)
        return cache

    # -- the verifier and what it found ---------------------------------------------------------
    def verifier(self, req) -> torch.Tensor:
        self.model.identity = req.extra_key
        k, v = self.model.read(req.slots[: req.prefix_len])
        ek, ev = self.model.expected(req.tokens, 0, req.prefix_len)
        bad = differs(k, ek) | differs(v, ev)
        if bool(bad.any()):
            ps = self.config.page_size
            self.pending[id(req)] = sorted({int(t) // ps for t in bad.nonzero().flatten()})
        return bad

    def after_verify(self, live, prompt_prefix: list[int], stood: bool) -> None:
        pages = self.pending.pop(id(live.req), None)
        if pages is None:
            return
        req, ps = live.req, self.config.page_size
        self.n["reached"] += 1
        assert not stood and req.prefix_len <= pages[0] * ps, (pages, req.prefix_len, self.n)
        self.n["caught"] += 1
        cache = self.cache
        for p in pages:  # gone from every tier: no match reaches it, the store lacks it
            end = (p + 1) * ps
            m = cache.tree.match(prompt_prefix[:end], probe=False, prior=req.prior)
            assert m.length <= p * ps, f"page {p} still matched ({m.length} tokens)"
        digests = page_digests(prompt_prefix[: (pages[-1] + 1) * ps], ps, req.prior)
        keys = page_keys_of(cache.manager.namespace, [digests[p] for p in pages])
        with self.silent.lock:
            assert all(self.raw_exists([k]) == 0 for k in keys), "a quarantined page is stored"
            self.silent.absent.update(bytes(k) for k in keys)
        held = self.held_outside()
        cache.manager.check_integrity(outside_device=held)

    def held_outside(self) -> int:
        """Device slots the live and finishing requests hold outside the tree (whole pages)."""
        ps = self.config.page_size
        reqs = [live.req for live in self.live] + self.finishing
        return sum(-(-(len(r.tokens) - r.prefix_len) // ps) * ps for r in reqs)

    def check_absent(self, cache) -> None:
        with self.silent.lock:
            back = [k for k in self.silent.absent if self.raw_exists([k])]
        assert not back, f"{len(back)} quarantined pages are in the store again, never re-stored"

    # -- the campaign's operations --------------------------------------------------------------
    def check(self, live, end: int, when: str) -> bool:
        """Before verification a wrong prefix is expected (counted apart, then verified)."""
        wrong, first = self.n["wrong"], self.first_wrong
        ok = super().check(live, end, when)
        if when.startswith("after begin"):
            self.n["pre_verify_wrong"] += self.n["wrong"] - wrong
            self.n["wrong"], self.first_wrong = wrong, first
        return ok

    def advance(self, live) -> None:
        if live.prepared:
            return super().advance(live)
        req = live.req
        self.model.identity = live.extra
        try:
            self.cache.prepare_forward(req)
        except StateError as exc:
            assert "load of this request's prefix failed" in str(exc), exc
            self.n["failed_prefix"] += 1
            return self.retry(live)
        rest = live.prompt[len(req.tokens) :]
        plain = self.cache.manager.window is None  # a window pool verifies before it extends
        if plain and rest and self.rng.random() < 0.3:  # slots first, no KV computed yet
            self.cache.extend(req, rest[: self.rng.randint(1, len(rest))])
            self.n["extended_first"] += 1
        prefix = list(req.tokens[: req.prefix_len])
        try:
            stood = self.cache.verify_restored(req)
        except StateError as exc:
            assert "no device room" in str(exc), exc
            self.n["no_room"] += 1
            self.pending.pop(id(req), None)
            return self.retry(live)
        self.after_verify(live, prefix, stood)
        if len(req.tokens) > req.prefix_len:  # what it holds slots for and must compute
            slots = req.slots[req.prefix_len :]
            self.model.write(req.tokens, req.prefix_len, len(req.tokens), slots)
        if not self.check(live, len(req.tokens), "after verify_restored"):
            return self.retry(live)
        live.prepared = True

    def restart(self) -> None:
        super().restart()
        self.check_absent(self.cache)


def _lively(c: VerifyCampaign) -> bool:
    return c.n["reached"] > 0 and c.n["restarts"] + c.n["extended_first"] > 0


def run_verify_campaign(tmp_path, gen, write_policy, prefetch_policy, kind="mha"):
    seed = campaign_seed(gen)
    print(f"verify campaign seed {seed} (TIERED_KV_CAMPAIGN_SEED={seed}), {kind} pool")
    c = VerifyCampaign(tmp_path, seed, write_policy, prefetch_policy, kind)
    ops = 0
    try:
        # OPS steps, then more (bounded) while no silent corruption has reached a prefix yet
        # (or neither a restart nor an extend-first request came): on a sliding-window pool
        # hits are rarer, and a seed may need longer, not forever.
        while ops < OPS or (ops < 4 * OPS and not _lively(c)):
            c.step()
            ops += 1
        c.settle()
        c.check_absent(c.cache)
        stats = c.cache.stats()["verify"]
    finally:
        c.cache.close()
    silent = c.silent.faults.fired
    print(f"ops {ops}, {c.n}, tier hits {c.tiers}, faults {c.faults.fired}, silent {silent}")
    print(f"cache's verify counters (this cache only): {stats}")
    assert c.n["wrong"] == 0, c.first_wrong  # nothing wrong served after verification
    assert c.n["caught"] == c.n["reached"], c.n
    assert c.n["reached"] > 0, f"no silent corruption reached a prefix: {c.n}, {silent}"
    assert c.n["begins"] > OPS // 20 and c.n["restarts"] + c.n["extended_first"] > 0, c.n
    assert sum(silent.values()) > 0 and sum(c.faults.fired.values()) > 0
    return c


@pytest.mark.parametrize("write_policy", WritePolicy.values())
def test_silent_corruption_is_caught_and_quarantined(tmp_path, gen, write_policy):
    run_verify_campaign(tmp_path, gen, write_policy, PrefetchPolicy.WAIT_COMPLETE.value)


@pytest.mark.parametrize("kind", ["swa", "dsa"])
def test_silent_corruption_on_window_and_indexer_pools(tmp_path, gen, kind):
    """Window layers are checked where the next query reads them; DSA's indexer keys with the
    latents. Requests of these pools are verified before they extend (the campaign's extend
    first then only allocates for the plain pool)."""
    run_verify_campaign(tmp_path, gen, WritePolicy.WRITE_THROUGH.value, "timeout", kind)
