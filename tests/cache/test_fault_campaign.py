"""Issue 12: a seeded random fault campaign through the facade, over every write and prefetch
policy (and a host layout and io backend drawn per seed). Up to four requests live at once on
prompts that share random-length prefixes; their extends, decodes, finishes and aborts
interleave at random with polls, drains, device pressure, tree clears and restarts (close, then
a new cache over the same store). Faults fire at random (about 10% of calls) in every device <->
host copy (half of them after copying the wrong rows; a layer-wise load fails at one layer, its
other layers land) and in every call into the LMDB store (raising OSError or lmdb.Error, or
failing part of a batch and scribbling on the host pages it reports unread), with slow loads and
reads so that later requests find copies in flight.

Some requests are begun together (``begin_many``: their host hits load as one job), and some
are finished together (``finish_many``: their write-through copies go as one job).
Every served prefix is read back through the device pool's buffer getters (most of the time
right after ``begin``, always after ``prepare_forward``, and the whole sequence before
``finish``) and compared, bit for bit, with the KV the stand-in model gave those tokens. A fault
may only surface as a miss, as ``prepare_forward``'s StateError for a failed prefix load, or as
the copy's own error in the forward's layer wait; the request is then aborted and begun again.
Rerun a failure with ``TIERED_KV_CAMPAIGN_SEED=<printed seed>`` (a bigger campaign with
``TIERED_KV_CAMPAIGN_OPS``); copy and store threads make the exact interleaving vary per run.
"""

from __future__ import annotations

import dataclasses
import os
import random
import threading
import zlib
from dataclasses import dataclass

import lmdb
import pytest
import torch

from tests.cache.test_facade import Model, make_config
from tiered_kv.cache import TieredKVCache
from tiered_kv.cache.request import Request
from tiered_kv.errors import StateError, TransferError
from tiered_kv.names import HostLayout, IOBackend, PrefetchPolicy, WritePolicy

MAX_LIVE = 4
MAX_PROMPT = 40
MAX_DECODE = 6
OPS = int(os.environ.get("TIERED_KV_CAMPAIGN_OPS", 2000))
ENGINE_KINDS = ("mha", "hybrid")  # pools with one host pool (its copies may run as engine jobs)
DRAW = object()  # begin: draw the request's identity


class InjectedCopyFault(RuntimeError):
    """Raised by a device <-> host copy the campaign breaks."""


class Faults:
    """Which calls fail: one seeded stream per fault point (so each point's decisions do not
    depend on how the threads calling the others interleave), counted per point."""

    def __init__(self, seed: int, rate: float) -> None:
        self.seed = seed
        self.rate = rate
        self._rngs: dict[str, random.Random] = {}
        self._lock = threading.Lock()
        self.fired: dict[str, int] = {}

    def roll(self, point: str, rate: float | None = None) -> float | None:
        """A uniform draw in [0, 1) when ``point`` fails this call, else None."""
        with self._lock:
            rng = self._rngs.get(point)
            if rng is None:
                rng = self._rngs[point] = random.Random(self.seed ^ zlib.crc32(point.encode()))
            if rng.random() >= (self.rate if rate is None else rate):
                return None
            self.fired[point] = self.fired.get(point, 0) + 1
            return rng.random()


def break_copies(host, faults: Faults) -> None:
    """The host pool's device <-> host copies fail at random (instance attributes)."""
    real_backup, real_load = host.backup_from_device_all_layer, host.load_to_device_per_layer

    def backup(pool, host_indices, device_indices, io_backend="kernel"):
        draw = faults.roll("backup_from_device", 1.5 * faults.rate)  # fewer calls than loads
        if draw is not None:
            if draw < 0.5:  # half done: wrong rows copied, then the error
                real_backup(pool, host_indices, device_indices.flip(0), io_backend)
            raise InjectedCopyFault("backup_from_device_all_layer")
        real_backup(pool, host_indices, device_indices, io_backend)

    def load(pool, host_indices, device_indices, layer_id, io_backend="kernel"):
        if faults.roll("load_delay", 0.2) is not None:
            threading.Event().wait(0.002)  # a slow copy: later begins find it in flight
        draw = faults.roll("load_to_device")  # per layer: some layers land, some do not
        if draw is not None:
            if draw < 0.5:
                real_load(pool, host_indices.flip(0), device_indices, layer_id, io_backend)
            raise InjectedCopyFault(f"load_to_device_per_layer layer {layer_id}")
        real_load(pool, host_indices, device_indices, layer_id, io_backend)

    host.backup_from_device_all_layer = backup
    host.load_to_device_per_layer = load


def break_engine_jobs(host, faults: Faults) -> None:
    """The copy engine's jobs fail at random instead (the copy methods stay the pool's own, so
    the engine runs them): a write refused whole (nothing copied), a load whose rows are
    permuted (wrong bytes land in its own destination slots) with one layer refused, so the
    load fails; building a job raises now and then."""
    real = host.row_job

    def row_job(pool, host_indices, device_indices, to_host, io_backend="kernel"):
        job = real(pool, host_indices, device_indices, to_host, io_backend)
        if job is None:
            return None
        draw = faults.roll("engine_job", 1.5 * faults.rate if to_host else faults.rate)
        if draw is None:
            return job
        if draw < 0.2:
            raise InjectedCopyFault("row_job")
        if to_host:
            return dataclasses.replace(job, threads=0)
        order = job.layers.tolist()
        order[int(draw * len(order)) % len(order)] = job.shape.total_layers
        return dataclasses.replace(
            job, dev_rows=job.dev_rows.flip(0), shape=job.shape.with_layers(order)
        )

    host.row_job = row_job


def store_error(what: str, draw: float) -> Exception:
    return OSError(5, f"injected EIO in {what}") if draw < 0.5 else lmdb.Error(what)


def break_store(store, faults: Faults) -> None:
    """The LMDB store's calls raise OSError or lmdb.Error at random, or fail part of a batch."""
    real_exists, real_get, real_set = store.batch_exists, store.batch_get, store.batch_set

    def batch_exists(keys):
        draw = faults.roll("batch_exists")
        if draw is not None and draw < 0.6:
            raise store_error("batch_exists", draw / 0.6)
        found = real_exists(keys)
        return found if draw is None else int(found * (draw - 0.6) / 0.4)  # fewer than held

    def batch_get(keys, source, pages):
        if faults.roll("get_delay", 0.2) is not None:
            threading.Event().wait(0.004)  # a slow read: a timeout prefetch is cut short
        draw = faults.roll("batch_get")
        if draw is None:
            return real_get(keys, source, pages)
        ok = real_get(keys, source, pages)
        cut = int(len(keys) * draw)
        junk = torch.full((source.page_nbytes,), 0xA5, dtype=torch.uint8)
        for page in pages[cut:]:  # pages reported unread may hold anything
            source.set_page_bytes(page, junk)
        if draw < 0.5:
            raise store_error("batch_get", draw * 2)
        return ok[:cut] + [False] * (len(keys) - cut)

    def batch_set(keys, source, pages):
        draw = faults.roll("batch_set")
        if draw is None:
            return real_set(keys, source, pages)
        if draw < 0.5:
            raise store_error("batch_set", draw * 2)
        cut = int(len(keys) * (draw - 0.5) * 2)  # a prefix is stored, the rest is not
        return real_set(keys[:cut], source, pages[:cut]) + [False] * (len(keys) - cut)

    store.batch_exists, store.batch_get, store.batch_set = batch_exists, batch_get, batch_set


def inject(cache: TieredKVCache, faults: Faults, engine: bool) -> None:
    """Break this cache's copies (the host pool's copy methods, or with ``engine`` the copy
    engine's jobs) and its LMDB store (the one its GuardedStorage wraps, when it has one; then
    calls into the guard itself raise now and then as well)."""
    if engine:
        break_engine_jobs(cache.host_pool, faults)
    else:
        break_copies(cache.host_pool, faults)
    break_guarded(cache.storage, faults)


def break_guarded(outer, faults: Faults) -> None:
    """The store a GuardedStorage wraps (or ``outer`` itself) fails at random; then calls into
    the guard itself raise now and then as well."""
    inner = getattr(outer, "inner", None)
    break_store(inner if inner is not None else outer, faults)
    if inner is None:
        return
    for name in ("batch_exists", "batch_get", "batch_set"):
        real = getattr(outer, name)

        def call(*args, _real=real, _name=name):
            if faults.roll(f"guard_{_name}", faults.rate / 4) is not None:
                raise store_error(_name, 0.0)
            return _real(*args)

        setattr(outer, name, call)


@dataclass
class Live:
    req: Request
    prompt: list[int]
    decode_left: int
    prepared: bool = False
    extra: str | bytes | None = None  # the request's identity (begin's extra_key)


class Campaign:
    """The serving loop under faults, with the oracle's counts (``n``) and tier hits."""

    model_cls = Model  # the stand-in model: KV per token prefix

    def __init__(
        self,
        tmp_path,
        seed: int,
        write_policy: str,
        prefetch_policy: str,
        kind: str = "mha",
        **changes,
    ) -> None:
        self.rng = random.Random(seed)
        self.faults = Faults(seed, rate=0.1)
        # Half the seeds break the copy engine's jobs (which the kernel io backend uses), half
        # the host pool's copy methods. A host pool group (SWA, DSA) has no engine path.
        self.engine = seed % 2 == 1 and kind in ENGINE_KINDS
        window = self.model_fields(kind)
        io = IOBackend.KERNEL.value if self.engine else self.rng.choice(IOBackend.values())
        self.config = make_config(
            tmp_path,
            device_tokens=192,  # >= MAX_LIVE requests of MAX_PROMPT + MAX_DECODE tokens
            host_tokens=256,
            max_requests=MAX_LIVE + 2,
            write_policy=write_policy,
            selective_hits=1,  # copied on its first reuse: more copies (and faults) under it
            prefetch_policy=prefetch_policy,
            prefetch_timeout_base_s=0.002,
            prefetch_timeout_per_1k_s=0.05,
            prefetch_timeout_max_s=0.01,
            storage_batch_pages=2,
            host_layout=self.rng.choice(HostLayout.values()),
            io_backend=io,
            **{**window, **changes},
        )
        counts = (
            "begins",
            "batched",
            "checked",
            "wrong",
            "failed_prefix",
            "forward_failed",
            "failed_late",
        )
        self.n = dict.fromkeys((*counts, "restarts", "stored_found", "finished_together"), 0)
        self.cache = self._open()
        self.model = self.model_cls(self.cache, torch.Generator().manual_seed(seed))
        self.live: list[Live] = []
        self.finishing: list[Request] = []  # checked, finished later together (finish_many)
        self.prompts: list[list[int]] = []
        self.tiers = {"device": 0, "host": 0, "storage": 0}
        self.first_wrong: str | None = None
        self.window_before: dict[str, int] = {}  # window counters of the caches before restarts
        self.extra_keys: list | None = None  # identities drawn per request (None: no extra key)

    def model_fields(self, kind: str) -> dict:
        """The config fields of this pool kind beyond the campaign's own."""
        return {
            # A window shorter than most prompts: requests release window KV, tombstones form.
            "swa": dict(model="swa", full_layer_every=2, sliding_window=9),
            "dsa": dict(model="dsa", kv_lora_rank=16, qk_rope_head_dim=8),
            # A HiSparse allocator under the dense path: logical ids translated on every copy.
            "hisparse": dict(
                model="dsa", kv_lora_rank=16, qk_rope_head_dim=8, hisparse_logical_ratio=2
            ),
        }.get(kind, {})

    def _open(self) -> TieredKVCache:
        cache = TieredKVCache(self.config)
        if self.config.geometry.model == "swa":
            # Window slots must differ from full slots (else a wrong-pool index goes unseen).
            assert cache.allocator.swa_attn_allocator.alloc(3 * self.config.page_size) is not None
            cache._initial = cache.free_sizes()  # the reserved pages are nobody's to return
            cache.manager._device0 = cache.allocator.full_available_size()
        if self.config.device.hisparse_logical_ratio:
            # Logical ids must differ from device slots (else an untranslated id goes unseen).
            assert cache.allocator.logical_allocator.alloc(3 * self.config.page_size) is not None
            cache._initial = cache.free_sizes()
        inject(cache, self.faults, self.engine)
        probe = cache.manager.probe_storage

        def counted(keys):
            found = probe(keys)
            self.n["stored_found"] += found
            return found

        cache.manager.probe_storage = counted
        return cache

    # -- the oracle -----------------------------------------------------------------------------
    def check(self, live: Live, end: int, when: str) -> bool:
        """Compare ``end`` tokens of the request's KV with the model's; False when the forward
        hit its prefix load's copy error (the caller aborts the request)."""
        req = live.req
        self.model.identity = live.extra
        # What a reader of a failed load hits, whether the copy method raised (the injected
        # error, its cause) or the copy engine refused a layer: one TransferError.
        try:
            k, v = self.model.read(req.slots[:end])
        except TransferError:
            self.n["forward_failed"] += 1
            return False
        ek, ev = self.model.expected(req.tokens, 0, end)
        bad = differs(k, ek) | differs(v, ev)
        self.n["checked"] += end
        wrong = int(bad.sum())
        if wrong:
            self.n["wrong"] += wrong
            self.first_wrong = self.first_wrong or (
                f"{wrong}/{end} tokens wrong {when} (tokens {bad.nonzero().flatten()[:8].tolist()}"
                f", hits {req.hits}, ops {self.n})"
            )
        return True

    # -- operations -----------------------------------------------------------------------------
    def new_prompt(self) -> list[int]:
        rng = self.rng
        if self.prompts and rng.random() < 0.4:  # served again, most often a recent one
            return rng.choice(self.prompts[-12:] if rng.random() < 0.7 else self.prompts)
        fresh = [rng.randrange(50_000) for _ in range(rng.randint(2, MAX_PROMPT))]
        if self.prompts and rng.random() < 0.8:  # a random-length prefix of an earlier prompt
            base = rng.choice(self.prompts)
            fresh = base[: rng.randint(1, len(base))] + fresh
        prompt = fresh[:MAX_PROMPT]
        self.prompts.append(prompt)
        return prompt

    def draw_extra(self):
        """A request identity: None, or one of ``extra_keys`` (same tokens, other KV)."""
        return self.rng.choice(self.extra_keys) if self.extra_keys else None

    def begin(self, prompt: list[int], extra=DRAW) -> None:
        extra = self.draw_extra() if extra is DRAW else extra
        live = self.begun(self.cache.begin(prompt, extra_key=extra), prompt, extra)
        if self.rng.random() < 0.6 and not self.check(live, live.req.prefix_len, "after begin"):
            self.retry(live)

    def begin_batch(self, prompts: list[list[int]]) -> None:
        """Requests whose forward runs together: their host hits load as one job, the layer
        waits follow it. All are read before any is begun again (a retry moves the waits)."""
        extras = [self.draw_extra() for _ in prompts]
        reqs = self.cache.begin_many(prompts, extra_keys=extras)
        self.n["batched"] += len(reqs)
        lives = [self.begun(r, p, e) for r, p, e in zip(reqs, prompts, extras, strict=True)]
        failed = [
            live
            for live in lives
            if self.rng.random() < 0.6
            and not self.check(live, live.req.prefix_len, "after begin_many")
        ]
        for live in failed:
            self.retry(live)

    def begun(self, req: Request, prompt: list[int], extra=None) -> Live:
        h = req.hits
        assert h.device + h.host + h.storage + h.missed == len(prompt) and h.missed >= 1, h
        assert req.tokens == prompt[: req.prefix_len] and len(req.slots) == req.prefix_len
        self.n["begins"] += 1
        for t in self.tiers:
            self.tiers[t] += getattr(h, t)
        live = Live(req, prompt, self.rng.randint(0, MAX_DECODE), extra=extra)
        self.live.append(live)
        return live

    def retry(self, live: Live) -> None:
        """The forward failed on the request's prefix: abort it and begin it again."""
        self.abort(live)
        self.begin(live.prompt, live.extra)

    def abort(self, live: Live) -> None:
        self.cache.abort(live.req)
        self.live.remove(live)

    def advance(self, live: Live) -> None:
        req, rng = live.req, self.rng
        self.model.identity = live.extra
        if not live.prepared:
            try:
                self.cache.prepare_forward(req)
            except StateError as exc:
                assert "load of this request's prefix failed" in str(exc), exc
                self.n["failed_prefix"] += 1
                return self.retry(live)
            if not self.check(live, req.prefix_len, "after prepare_forward"):
                return self.retry(live)
            live.prepared = True
        elif len(req.tokens) < len(live.prompt):
            rest = live.prompt[len(req.tokens) :]
            self.model.compute(req, rest[: rng.randint(1, len(rest))])
        elif live.decode_left:
            live.decode_left -= 1
            slot = self.cache.decode(req, rng.randrange(50_000))
            self.model.write(req.tokens, len(req.tokens) - 1, len(req.tokens), slot)
        else:
            try:
                self.cache.prepare_forward(req)  # the whole sequence, as the last forward reads
            except StateError:
                self.n["failed_late"] += 1  # its prefix check passed, yet its prefix load failed
                return self.abort(live)
            if self.check(live, len(req.tokens), "before finish"):
                self.live.remove(live)
                if rng.random() < 0.4:  # finished later with others (one write job)
                    self.finishing.append(req)
                else:
                    self.cache.finish(req)
                if len(req.tokens) > len(live.prompt):
                    self.prompts.append(req.tokens[:MAX_PROMPT])  # decoded tokens are cached too
            else:
                self.abort(live)

    def finish_batch(self) -> None:
        reqs, self.finishing = self.finishing, []
        if reqs:
            self.cache.finish_many(reqs)
            self.n["finished_together"] += len(reqs)

    def step(self) -> None:
        rng, cache = self.rng, self.cache
        if self.finishing and (len(self.finishing) >= 3 or rng.random() < 0.2):
            self.finish_batch()
        r = rng.random()
        held = len(self.live) + len(self.finishing)  # both hold device slots and a row
        if r < 0.2 and held < MAX_LIVE:
            room = MAX_LIVE - held
            if room > 1 and rng.random() < 0.3:
                self.begin_batch([self.new_prompt() for _ in range(rng.randint(2, room))])
            else:
                self.begin(self.new_prompt())
        elif r < 0.85 and self.live:
            live = rng.choice(self.live)
            if rng.random() < 0.04:
                self.abort(live)
            else:
                self.advance(live)
        elif r < 0.92:
            cache.poll()
        elif r < 0.95:
            cache.drain()
        elif r < 0.953:
            cache.clear_tree()
        elif r < 0.986:  # device pressure from elsewhere: host copies stay, the rest goes
            cache.manager.evict_device(rng.randint(8, 128))
        elif r < 0.988:
            self.restart()

    def settle(self) -> None:
        """Finish or abort every live request, then every slot and row must be back."""
        self.finish_batch()
        while self.live:
            if self.rng.random() < 0.5:
                self.abort(self.live[0])
            else:
                self.advance(self.live[0])
        self.finish_batch()
        cache = self.cache
        cache.drain()
        cache.clear_tree()
        cache.manager.check_integrity()
        assert cache.free_sizes() == cache._initial, (cache.free_sizes(), cache._initial)
        assert cache.stats()["occupancy"] == {"device_tokens": 0, "host_tokens": 0}

    def window_counts(self) -> dict[str, int]:
        """Window KV released and matches trimmed over the whole campaign (each restart opens
        a cache whose counters start at 0)."""
        now = dataclasses.asdict(self.cache.metrics.window)
        return {k: self.window_before.get(k, 0) + v for k, v in now.items()}

    def restart(self) -> None:
        self.settle()
        self.window_before = self.window_counts()
        self.cache.close()
        self.cache = self.model.cache = self._open()
        self.n["restarts"] += 1


def differs(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per token (dim 1 of [layers, tokens, ...]): whether any byte differs."""
    g = got.contiguous().flatten(2).view(torch.uint8)
    w = want.contiguous().flatten(2).view(torch.uint8)
    return (g != w).any(dim=2).any(dim=0)


def campaign_seed(gen: torch.Generator) -> int:
    override = os.environ.get("TIERED_KV_CAMPAIGN_SEED")
    return int(override) if override else int(torch.randint(0, 2**31, (1,), generator=gen))


@pytest.mark.parametrize("prefetch_policy", PrefetchPolicy.values())
@pytest.mark.parametrize("write_policy", WritePolicy.values())
def test_fault_campaign_serves_only_exact_kv(tmp_path, gen, write_policy, prefetch_policy):
    run_campaign(tmp_path, gen, write_policy, prefetch_policy, "mha")


@pytest.mark.parametrize("prefetch_policy", PrefetchPolicy.values())
def test_fault_campaign_on_a_sliding_window_pool(tmp_path, gen, prefetch_policy):
    """Issue 14: the same campaign on full and window sub-pools moved as one host group."""
    run_campaign(tmp_path, gen, WritePolicy.WRITE_THROUGH.value, prefetch_policy, "swa")


@pytest.mark.parametrize("prefetch_policy", PrefetchPolicy.values())
@pytest.mark.parametrize("kind", ["dsa", "hisparse"])
def test_fault_campaign_on_a_dsa_pool(tmp_path, gen, prefetch_policy, kind):
    """Issue 14: latents and indexer keys (two declared host pools moved and stored as one)
    under the same faults; every served token's latent and indexer row is checked. Issue 29:
    the same over a HiSparse allocator (the request's slots are logical ids)."""
    run_campaign(tmp_path, gen, WritePolicy.WRITE_THROUGH.value, prefetch_policy, kind)


def run_campaign(tmp_path, gen, write_policy, prefetch_policy, kind):
    seed = campaign_seed(gen)
    print(f"fault campaign seed {seed} (TIERED_KV_CAMPAIGN_SEED={seed}), {kind} pool")
    c = Campaign(tmp_path, seed, write_policy, prefetch_policy, kind)
    print(
        f"host layout {c.config.host.host_layout}, io backend {c.config.host.io_backend}, "
        f"faults in {'copy-engine jobs' if c.engine else 'the copy methods'}"
    )
    try:
        for _ in range(OPS):
            c.step()
        c.settle()
    finally:
        c.cache.close()
    fired = c.faults.fired
    print(f"ops {OPS}, {c.n}, tier hits {c.tiers}, faults {fired}")
    assert c.n["wrong"] == 0, c.first_wrong
    assert c.n["checked"] > 0 and c.n["begins"] > OPS // 20 and c.n["batched"], c.n
    assert c.n["finished_together"], c.n
    assert c.tiers["device"] and c.tiers["host"], f"a tier was never hit: {c.tiers}"
    if kind == "swa":  # requests gave window KV back: tombstones were formed and matched
        window = c.window_counts()
        assert window["released_tokens"] and window["trimmed_tokens"], window
    if prefetch_policy == PrefetchPolicy.BEST_EFFORT:
        # begin never waits: a prefetch mostly loses the race with its own cancel (by design);
        # the store must still have been found holding pages.
        assert c.n["stored_found"] > 0, c.n
    else:
        assert c.tiers["storage"], f"storage was never hit: {c.tiers}"
    copy_faults = sum(
        fired.get(p, 0) for p in ("backup_from_device", "load_to_device", "engine_job")
    )
    store_faults = sum(n for point, n in fired.items() if "batch_" in point)
    assert copy_faults and store_faults, fired
