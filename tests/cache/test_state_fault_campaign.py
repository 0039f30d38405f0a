"""Issue 15: the random fault campaign (``test_fault_campaign``) on a hybrid model, where a cached
prefix is served only with the recurrent state at its end.

The stand-in model gives every token prefix its KV (full-attention layers) and its state: every
part of every declared state pool of the request's slot (conv history and recurrent state per
recurrent layer, the n-gram sibling) drawn from a generator seeded by a hash of the prefix. The
serving loop writes, after each forward, the state after the request's tokens, and at each page
boundary it crossed first the state there, then ``track_state``, as an engine does. After every
``begin`` and ``prepare_forward`` the request's slot must hold, byte for byte, the state after
its granted prefix (zeros for none), and before every forward the state after its tokens; a
differing state is counted and fails the run, as wrong KV does. So does a snapshot that the
ledger holds on the device or the host and that is not the state after the prefix its digest
names (checked after every forward for the snapshots it may have taken, and now and then for
all): it is a wrong state waiting for its hit.

On top of every fault of the KV campaign, the state side fails at random (about 10% of calls):
the state store (its GuardedStorage and the store inside it) raises, fails part of a batch,
scribbles on the host slot it reports unread, or claims a snapshot it then cannot serve; the
ledger's copies (``copy_from`` of the Mamba pool, the host state pool's ``load_to_device`` and
``backup_from_device``) raise, half of them after copying the wrong row or only some of the
parts. Tiny device and host state pools move snapshots between tiers all the time, and Mamba
slots held elsewhere now and then press on ``begin`` (a refusal is the documented StateError).
Some forwards are careless: they run over a prefix whose load failed (the error ignored) and
compute a wrong state from it, and half of those requests are finished without a last check;
the cache must keep none of it.
Rerun a failure with ``TIERED_KV_CAMPAIGN_SEED=<printed seed>``.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from tests.cache.test_facade import Model
from tests.cache.test_fault_campaign import (
    MAX_LIVE,
    Campaign,
    InjectedCopyFault,
    Live,
    break_guarded,
    differs,
)
from tiered_kv.errors import StateError, TransferError
from tiered_kv.names import PrefetchPolicy, WritePolicy
from tiered_kv.storage.keys import page_digests

OPS = int(os.environ.get("TIERED_KV_CAMPAIGN_OPS", 1200))
# Run i: SEEDS[i] under PrefetchPolicy.values()[i], every write policy (each of the nine restores
# from every state tier); another seed: TIERED_KV_CAMPAIGN_SEED.
SEEDS = (16, 19, 12)  # 19: faults in the copy engine's jobs (an odd seed)
CARELESS = 0.5  # first forwards that go on over a failed prefix load


class HybridModel(Model):
    """KV of the full-attention layers only (the recurrent layers keep a state, no KV)."""

    def __init__(self, cache, gen: torch.Generator) -> None:
        super().__init__(cache, gen)
        g = cache.config.geometry
        self.full = g.hybrid_layer_ids()[0]
        self.layers = len(self.full)
        self.k_shape = (self.layers, g.head_num, g.head_dim)
        self.v_shape = (self.layers, g.head_num, g.v_head_dim or g.head_dim)

    def write(self, tokens, start: int, end: int, slots: torch.Tensor) -> None:
        k, v = self.produced(tokens, start, end)
        for i, layer in enumerate(self.full):
            self.cache.write_kv(layer, slots, k[i], v[i])

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pool = self.cache.device_pool
        k = torch.stack([pool.get_key_buffer(g)[slots] for g in self.full])
        v = torch.stack([pool.get_value_buffer(g)[slots] for g in self.full])
        return k, v


class StateOracle:
    """The state after a token prefix, per declared part (``salt``: a wrong state's)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.parts: list = []
        self._memo: dict[tuple, list[torch.Tensor]] = {}

    def bind(self, cache) -> None:
        """The parts of ``cache``'s state slots (a new cache after a restart)."""
        self.parts = [p for d in cache.req_to_token.state_pool_decls() for p in d.parts]

    def expected(self, tokens, salt: int = 0) -> list[torch.Tensor]:
        key = (salt, *tokens)
        got = self._memo.get(key)
        if got is not None:
            return got
        if not tokens:  # a fresh slot: zeros (the n-gram pool's fill value is 0 as well)
            got = [torch.zeros(p.slot_shape, dtype=p.dtype) for p in self.parts]
        else:
            h = hashlib.blake2b(repr(key).encode(), digest_size=8, key=str(self.seed).encode())
            gen = torch.Generator().manual_seed(int.from_bytes(h.digest()) >> 1)
            got = [
                torch.randn(p.slot_shape, generator=gen).to(p.dtype)
                if p.dtype.is_floating_point
                else torch.randint(1, 1 << 30, p.slot_shape, generator=gen, dtype=p.dtype)
                for p in self.parts
            ]
        self._memo[key] = got
        return got

    def write(self, slot: int, tokens, salt: int = 0) -> None:
        for p, t in zip(self.parts, self.expected(tokens, salt), strict=True):
            p.buffer()[slot] = t

    def differs(self, slot: int, tokens, salt: int = 0) -> list[str]:
        """The names of the parts of ``slot`` that differ from the state after ``tokens``."""
        return [
            p.name
            for p, t in zip(self.parts, self.expected(tokens, salt), strict=True)
            if not torch.equal(p.buffer()[slot].view(torch.uint8), t.view(torch.uint8))
        ]

    def host_differs(self, host, slot: int, tokens) -> bool:
        """Whether host state slot ``slot`` differs from the state after ``tokens`` (a host
        slot is every part's bytes in declaration order)."""
        want = torch.cat([t.reshape(-1).view(torch.uint8) for t in self.expected(tokens)])
        return not torch.equal(host.get_page_bytes(slot), want)


def scribble(parts, slot: int, draw: float) -> None:
    """Junk in some of the parts of device state slot ``slot``."""
    for p in parts[: 1 + int(draw * 997) % len(parts)]:
        p.buffer()[slot].view(torch.uint8).fill_(0xA5)


def break_state_copies(ledger, parts, faults) -> None:
    """The ledger's copies (and the tracking copy, which is the same ``copy_from``) fail at
    random: a quarter after copying the wrong row, a quarter after copying only some parts."""
    pool, host = ledger.pool, ledger.host
    real_copy, real_load, real_backup = pool.copy_from, host.load_to_device, host.backup_from_device

    def other(slot: int, among: list[int]) -> int | None:
        rest = [s for s in among if s != slot]
        return rest[int(slot) % len(rest)] if rest else None

    def copy_from(src, dst):
        draw = faults.roll("state_copy_from")
        if draw is None:
            return real_copy(src, dst)
        s, d = int(src[0]), int(dst[0])
        if draw < 0.25:
            real_copy(torch.tensor([s % (pool.num_rows - 1) + 1]), dst)  # the wrong row
        elif draw < 0.5:
            for p in parts[: 1 + int(draw * 997) % (len(parts) - 1)]:  # some parts only
                p.buffer()[d] = p.buffer()[s]
        raise InjectedCopyFault("state copy_from")

    def load_to_device(host_slots, device_slots):
        draw = faults.roll("state_load_to_device")
        if draw is None:
            return real_load(host_slots, device_slots)
        d = int(device_slots[0])
        if draw < 0.25:
            wrong = other(int(host_slots[0]), ledger.host_slots())
            if wrong is None:
                scribble(parts, d, draw)
            else:
                real_load(torch.tensor([wrong]), device_slots)
        elif draw < 0.5:  # some parts land, the others keep what the slot held
            keep = 1 + int(draw * 997) % (len(parts) - 1)
            saved = [p.buffer()[d].clone() for p in parts[keep:]]
            real_load(host_slots, device_slots)
            for p, old in zip(parts[keep:], saved, strict=True):
                p.buffer()[d] = old
        raise InjectedCopyFault("state load_to_device")

    def backup_from_device(device_slots, host_slots):
        draw = faults.roll("state_backup_from_device")
        if draw is None:
            return real_backup(device_slots, host_slots)
        if draw < 0.25:
            real_backup(torch.tensor([int(device_slots[0]) % (pool.num_rows - 1) + 1]), host_slots)
        elif draw < 0.5:
            real_backup(device_slots, host_slots)
            h = int(host_slots[0])
            row = host.get_page_bytes(h).clone()
            row[int(draw * row.numel()) :] = 0xA5
            host.set_page_bytes(h, row)
        raise InjectedCopyFault("state backup_from_device")

    pool.copy_from = copy_from
    host.load_to_device, host.backup_from_device = load_to_device, backup_from_device


class Tagged:
    """The campaign's fault streams under a prefix (the state store's apart from the page
    store's)."""

    def __init__(self, faults, tag: str) -> None:
        self.faults, self.tag, self.rate = faults, tag, faults.rate

    def roll(self, point: str, rate: float | None = None) -> float | None:
        return self.faults.roll(self.tag + point, rate)


def break_state_store(ledger, faults) -> None:
    """The state store fails as the page store does (``break_guarded``), and now and then
    claims a snapshot it does not hold."""
    store = ledger.store.inner
    real_exists = store.batch_exists

    def batch_exists(keys):
        if faults.roll("state_batch_claims") is not None:
            return len(keys)
        return real_exists(keys)

    store.batch_exists = batch_exists
    break_guarded(ledger.store, Tagged(faults, "state_"))


class HybridCampaign(Campaign):
    model_cls = HybridModel

    def __init__(self, tmp_path, seed: int, write_policy: str, prefetch_policy: str) -> None:
        self.states = StateOracle(seed)
        self.hogged: list[int] = []  # Mamba slots held elsewhere (pressure on begin)
        self.prefixes: dict[bytes, tuple] = {}  # page digest -> the tokens it names
        self.salted: set[int] = set()  # id() of live requests computing a wrong state
        self.totals: dict[str, int] = {}
        super().__init__(tmp_path, seed, write_policy, prefetch_policy, "hybrid")
        counts = ("states_checked", "wrong_states", "snapshots_checked", "wrong_snapshots")
        self.n.update(dict.fromkeys((*counts, "refused", "careless", "salted", "salted_finish"), 0))
        self.first_wrong_state: str | None = None

    def model_fields(self, kind: str) -> dict:
        rng = self.rng
        extra = rng.random() < 0.8  # tracking slots (else the working slot, at a page end)
        overlap, lazy = rng.random() < 0.4, rng.random() < 0.3
        per_request = 1 + (0 if not extra else 2 if overlap else 1)  # a lazy one: in time
        self.spare = rng.randint(3, 8)  # Mamba slots beyond full live requests' own
        return dict(
            model="hybrid_linear", num_layers=4, full_layer_every=2, conv_kernel=3,
            linear_heads=2, linear_key_dim=4, linear_value_dim=6, ngram_context_len=5,
            state_snapshot_every=rng.choice((1, 2, 3)), state_extra_buffer=extra,
            state_overlap=overlap, state_lazy=lazy,
            # A few snapshots fit beside full live requests: begin evicts them.
            device_state_slots=per_request * MAX_LIVE + self.spare,
            host_state_slots=rng.randint(2, 4),
        )  # fmt: skip

    def _open(self):
        cache = super()._open()
        ledger = cache.states.ledger
        self.states.bind(cache)
        break_state_copies(ledger, self.states.parts, self.faults)
        break_state_store(ledger, self.faults)
        return cache

    # -- the state oracle -----------------------------------------------------------------------
    def salt(self, live: Live, end: int) -> int:
        """1 where the request's state after ``end`` tokens is a wrong one (computed by a
        careless forward over garbage KV), else 0."""
        return int(id(live) in self.salted and end > live.req.prefix_len)

    def check_state(self, live: Live, end: int, when: str) -> None:
        req = live.req
        bad = self.states.differs(req.kv.mamba_pool_idx, req.tokens[:end], self.salt(live, end))
        self.n["states_checked"] += 1
        if bad:
            self.n["wrong_states"] += 1
            self.first_wrong_state = self.first_wrong_state or (
                f"state after {end} tokens wrong {when} (parts {bad}, prefix {req.prefix_len}, "
                f"hits {req.hits}, ops {self.n}, state {self.cache.stats()['state']})"
            )

    def forward_state(self, live: Live, start: int) -> None:
        """What the forward of ``req.tokens[start:]`` leaves in the request's slot: the state
        at each page boundary it crossed (tracked there), then the state after its tokens."""
        req, ps = live.req, self.config.page_size
        slot = req.kv.mamba_pool_idx
        chain = page_digests(req.tokens[: len(req.tokens) - len(req.tokens) % ps], ps)
        for b in range(start - start % ps + ps, len(req.tokens) + 1, ps):
            self.prefixes[chain[b // ps - 1]] = tuple(req.tokens[:b])
            self.states.write(slot, req.tokens[:b], self.salt(live, b))
            if self.rng.random() < 0.9:  # an engine may skip a boundary
                self.cache.track_state(req, b)
        self.states.write(slot, req.tokens, self.salt(live, len(req.tokens)))
        self.audit_snapshots(chain[start // ps :])  # the snapshots this forward may have taken

    # -- operations -----------------------------------------------------------------------------
    def begun(self, req, prompt, extra=None):
        live = super().begun(req, prompt, extra)
        self.salted.discard(id(live))
        self.check_state(live, req.prefix_len, "after begin")
        return live

    def begin(self, prompt, *args):
        try:
            super().begin(prompt, *args)
        except StateError as exc:  # Mamba slots held elsewhere: the documented refusal
            assert "state slots" in str(exc), exc
            self.n["refused"] += 1

    def begin_batch(self, prompts):
        try:
            super().begin_batch(prompts)
        except StateError as exc:
            assert "state slots" in str(exc), exc
            self.n["refused"] += 1

    def advance(self, live: Live) -> None:
        req = live.req
        if not live.prepared and self.rng.random() < CARELESS:
            return self.careless_start(live)
        done = len(req.tokens) >= len(live.prompt) and not live.decode_left
        if done and id(live) in self.salted and self.rng.random() < 0.5:
            self.n["salted_finish"] += 1  # no last check: the cache must not keep any of it
            self.cache.finish(req)
            return self.live.remove(live)
        start, prepared = len(req.tokens), live.prepared
        if prepared:
            self.check_state(live, start, "before a forward")
        super().advance(live)
        if req.finished:
            return
        if live.prepared and not prepared:
            self.check_state(live, start, "after prepare_forward")
        if len(req.tokens) > start:
            self.forward_state(live, start)

    def careless_start(self, live: Live) -> None:
        """A forward that waits for its prefix's layers but goes on over a failed load (its
        StateError or the layer's error ignored): it computes a wrong state from the garbage
        (and is aborted at its last check, before finish)."""
        req = live.req
        self.n["careless"] += 1
        try:
            self.cache.prepare_forward(req)
        except StateError:  # the failed load's KV is garbage here: compared, never counted
            try:
                k, v = self.model.read(req.slots[: req.prefix_len])
                ek, ev = self.model.expected(req.tokens, 0, req.prefix_len)
                garbage = bool((differs(k, ek) | differs(v, ev)).any())
            except TransferError:  # the failed load's layer (the injected error its cause)
                garbage = True
        else:
            garbage = not self.check(live, req.prefix_len, "after a careless prepare_forward")
        if garbage:
            self.salted.add(id(live))
            self.n["salted"] += 1
        else:
            self.check_state(live, req.prefix_len, "after prepare_forward")
        live.prepared = True

    def step(self) -> None:
        rows = self.cache.req_to_token
        r = self.rng.random()
        # Another owner takes Mamba slots for a little while, up to a little more than the
        # snapshots' share: a begin beside full live requests may be refused.
        if r < 0.02 and len(self.hogged) <= self.spare:
            got = rows.mamba_allocator.alloc(self.rng.randint(1, 2))
            self.hogged += got.tolist() if got is not None else []
        elif r < 0.07 and self.hogged:
            self.release_hogged()
        elif r < 0.09:
            self.check_slots()
            self.audit_snapshots()
        else:
            super().step()

    def release_hogged(self) -> None:
        if self.hogged:
            self.cache.req_to_token.mamba_allocator.free(torch.tensor(self.hogged))
            self.hogged = []

    def audit_snapshots(self, digests=None) -> None:
        """Every snapshot the ledger holds on the device or the host (or those of ``digests``)
        is the state after the prefix its digest names (a wrong one is a wrong state waiting
        for its hit)."""
        ledger = self.cache.states.ledger
        for digest in list(ledger.snaps) if digests is None else digests:
            snap = ledger.snaps.get(digest)
            if snap is None:
                continue
            tokens = self.prefixes[digest]
            bad = []
            if snap.device is not None and self.states.differs(snap.device, tokens):
                bad.append(f"device slot {snap.device}")
            if snap.host is not None and self.states.host_differs(ledger.host, snap.host, tokens):
                bad.append(f"host slot {snap.host}")
            self.n["snapshots_checked"] += 1
            if bad:
                self.n["wrong_snapshots"] += 1
                self.first_wrong_state = self.first_wrong_state or (
                    f"the snapshot after {len(tokens)} tokens is wrong in {bad} (ops {self.n}, "
                    f"state {self.cache.stats()['state']})"
                )

    # -- bookkeeping ----------------------------------------------------------------------------
    def check_slots(self) -> None:
        """Every Mamba slot is free, a row's (own, tracking), a device snapshot's or held
        elsewhere, exactly once; every host state slot free or a host snapshot's."""
        cache = self.cache
        rows, ledger = cache.req_to_token, cache.states.ledger
        owned = rows.mamba_slots_in_use() + ledger.device_slots() + self.hogged
        free = rows.mamba_allocator.get_all_free_slots().tolist()
        assert len(set(owned)) == len(owned) and not set(owned) & set(free), (owned, free)
        assert len(free) + len(owned) == rows.mamba_pool.size, (len(free), len(owned))
        host = ledger.host_slots()
        assert len(set(host)) == len(host), host
        assert ledger.host.available_size() + len(host) == ledger.host.num_slots, host
        rows.check_integrity()
        ps = self.config.page_size
        held = [x.req for x in self.live] + self.finishing  # checked, finished later together
        own = sum(-(-len(r.tokens) // ps) * ps - r.prefix_len for r in held)
        cache.manager.check_integrity(outside_device=own)  # the live requests' own pages

    def settle(self) -> None:
        self.release_hogged()
        self.audit_snapshots()
        super().settle()
        self.check_slots()
        assert not self.cache.states.ledger.device_slots(), "device snapshots left after clear"

    def restart(self) -> None:
        self.settle()
        self.close()
        self.cache = self.model.cache = self._open()
        self.n["restarts"] += 1

    def close(self) -> None:
        for key, value in self.cache.stats()["state"].items():
            self.totals[key] = self.totals.get(key, 0) + value
        self.cache.close()


@pytest.mark.parametrize("run", range(len(SEEDS)))
@pytest.mark.parametrize("write_policy", WritePolicy.values())
def test_state_fault_campaign_serves_only_exact_kv_and_state(tmp_path, write_policy, run):
    seed = int(os.environ.get("TIERED_KV_CAMPAIGN_SEED", SEEDS[run]))
    run_hybrid_campaign(tmp_path, seed, write_policy, PrefetchPolicy.values()[run])


def test_state_fault_campaign_write_back_seed_11(tmp_path):
    """Seed 11 under write_back (device-only snapshots are common there) hit a KeyError: making
    room for a device snapshot backed another up to a full host tier, whose eviction forgot the
    very snapshot capture() was filling (StateLedger now protects the snapshots a call works
    on)."""
    policies = WritePolicy.WRITE_BACK.value, PrefetchPolicy.WAIT_COMPLETE.value
    run_hybrid_campaign(tmp_path, 11, *policies)


def run_hybrid_campaign(tmp_path, seed: int, write_policy: str, prefetch_policy: str) -> None:
    print(f"hybrid fault campaign seed {seed} (TIERED_KV_CAMPAIGN_SEED={seed}), {write_policy}")
    c = HybridCampaign(tmp_path, seed, write_policy, prefetch_policy)
    d, h = c.config.device, c.config.host
    print(
        f"{prefetch_policy}, host layout {h.host_layout}, io backend {h.io_backend}, faults in "
        f"{'copy-engine jobs' if c.engine else 'the copy methods'}; state slots "
        f"{d.device_state_slots} device, {h.host_state_slots} host, snapshot every "
        f"{d.state_snapshot_every}, tracking {d.state_extra_buffer} overlap {d.state_overlap} "
        f"lazy {d.state_lazy}"
    )
    try:
        for _ in range(OPS):
            c.step()
        c.settle()
    finally:
        c.close()
    fired, st = c.faults.fired, c.totals
    print(f"ops {OPS}, {c.n}, tier hits {c.tiers}\nstate {st}\nfaults {fired}")
    assert c.n["wrong"] == 0, c.first_wrong
    assert c.n["wrong_states"] == c.n["wrong_snapshots"] == 0, c.first_wrong_state
    assert c.n["checked"] > 0 and c.n["states_checked"] > c.n["begins"] > OPS // 20, c.n
    assert c.tiers["device"] and c.tiers["host"], f"a tier was never hit: {c.tiers}"
    restored = {t: st[f"restored_{t}"] for t in ("device", "host", "storage")}
    assert all(restored.values()), f"a state tier never restored: {restored}"
    copies = ("copy_from", "load_to_device", "backup_from_device")
    state_copy = sum(fired.get(f"state_{p}", 0) for p in copies)
    state_store = sum(n for p, n in fired.items() if p.startswith("state_") and "batch" in p)
    kv = sum(n for p, n in fired.items() if not p.startswith("state_"))
    assert state_copy and state_store and kv, fired
