"""Issue 29: a seeded random fault campaign over HiSparseServing (sparse requests of a DSA cache
built with ``hisparse_logical_ratio``).

Up to four sparse requests live at once on random prompts of irregular lengths that share
random-length prefixes (and are often served again, decoded tokens included), under a few
identities (``extra_key``). Their begins, prefills, admits, decode tokens, finishes and aborts
interleave at random with now and then a dense request (whose device-only nodes a sparse begin
writes to host), polls, drains, host and device pressure and restarts (every request settled,
the cache closed, a new one over the same store). Faults fire at random (about 10% of calls)
in every device <-> host copy (the prefix's copy into the staging rows, the backups of admit
and commit_token, the dense path's layer-wise loads: half of them after copying the wrong
rows), in the swap-in copy (``LayerRowLoader.load``, the same) and in every call into the LMDB
store (``test_fault_campaign.inject``).

The oracle: the prefix rows copied into the staging rows, the whole staged prompt before admit,
and at every decode step, for random layers and a random subset of positions (at most the
buffer), the latent rows at the device slots ``swap_in`` returns (failed positions retried,
bounded; they must read slot 0), and every position's ``score_keys`` row, compared bit for bit
with the stand-in model's (``test_facade.Model``). A fault may only surface as a counted miss
(``serving.counts``, ``SwapIn.failed``) or a refusal, never as another token's bytes. Rerun a
failure with ``TIERED_KV_CAMPAIGN_SEED=<printed seed>`` (a bigger one with
``TIERED_KV_CAMPAIGN_OPS``; past it the campaign keeps stepping, up to 4x, until every fault
point fired and every counted miss it asserts on happened).
"""

from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass

import pytest
import torch

from tests.cache.test_facade import LAYERS, PAGE, Model, make_config
from tests.cache.test_fault_campaign import (
    Faults,
    InjectedCopyFault,
    campaign_seed,
    differs,
    inject,
)
from tiered_kv.cache import TieredKVCache
from tiered_kv.cache.hisparse_serving import HiSparseServing, SparseRequest
from tiered_kv.device.dsa_pool import dequantize_index_k
from tiered_kv.errors import StateError, TransferError
from tiered_kv.host.layer_rows import LayerRowLoader
from tiered_kv.names import IOBackend, WritePolicy

MAX_LIVE = 4
MAX_PROMPT = 34
MAX_DECODE = 9
BUFFER = 2 * PAGE  # swap slots per request and layer
SWAP_TRIES = 8  # swap_in calls for one selection before giving up (counted, not failed)
OPS = int(os.environ.get("TIERED_KV_CAMPAIGN_OPS", 700))
IDENTITIES = (None, None, "lora-a", b"salt-b")


def break_prefix_copies(host, faults: Faults) -> None:
    """The host group's all-layer load (a sparse begin's prefix into its staging rows) fails
    at random, half the time after copying the wrong rows."""
    real = host.load_to_device_all_layer

    def load_all(pool, host_indices, device_indices, io_backend="kernel"):
        draw = faults.roll("load_to_device_all", 2 * faults.rate)  # one call per begin
        if draw is not None:
            if draw < 0.5:
                real(pool, host_indices.flip(0), device_indices, io_backend)
            raise InjectedCopyFault("load_to_device_all_layer")
        real(pool, host_indices, device_indices, io_backend)

    host.load_to_device_all_layer = load_all


def break_swap_in(monkeypatch, faults: Faults) -> None:
    """Every swapper's layer copy fails at random, half the time after landing wrong rows."""
    real = LayerRowLoader.load

    def load(self, layer_id, host_slots, dev_rows):
        draw = faults.roll("swap_in_load")
        if draw is not None:
            if draw < 0.5:
                real(self, layer_id, host_slots[::-1].copy(), dev_rows)
            raise InjectedCopyFault(f"LayerRowLoader.load layer {layer_id}")
        real(self, layer_id, host_slots, dev_rows)

    monkeypatch.setattr(LayerRowLoader, "load", load)


@dataclass(eq=False)  # requests are told apart by identity (``live.remove``)
class Live:
    req: SparseRequest
    extra: str | bytes | None
    decode_left: int
    computed: bool = False  # the prefill wrote its positions (admit may still have failed)
    pending: bool = False  # a decode token begun, its commit_token not yet through
    decoded: bool = False


class SparseCampaign:
    """Sparse requests under faults, with the oracle's counts (``n``) and tier hits."""

    def __init__(
        self, tmp_path, seed: int, write_policy: str, host_layout: str, tight: bool = False
    ) -> None:
        self.rng = random.Random(seed)
        self.faults = Faults(seed, rate=0.1)
        self.config = make_config(
            tmp_path,
            model="dsa",
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            hisparse_logical_ratio=4,
            # Staging rows of a few prompts or a few buffers; tight: begins refused for room
            device_tokens=64 if tight else 96,
            host_tokens=112 if tight else 160,  # live tokens and the tree's: evicted to storage
            max_requests=MAX_LIVE + 4,
            write_policy=write_policy,
            host_layout=host_layout,
            io_backend=self.rng.choice(IOBackend.values()),
            storage_batch_pages=2,
        )
        self.copy_mode = self.rng.choice(("auto", "numpy"))
        self.n = dict.fromkeys(
            (
                "begins", "refused", "checked", "wrong", "swap_calls", "swap_loaded",
                "swap_failed", "swap_gave_up", "scored", "token_refused", "dense",
                "dense_failed", "restarts",
            ),
            0,
        )  # fmt: skip
        self.tiers = {"device": 0, "host": 0, "storage": 0}
        self.storage_after_restart = 0
        self.counts = {}  # serving.counts summed over the caches before restarts
        self.first_wrong: str | None = None
        self.cache, self.serving = self._open()
        self.model = Model(self.cache, torch.Generator().manual_seed(seed))
        self.live: list[Live] = []
        self.prompts: list[tuple[list[int], object]] = []

    def _open(self) -> tuple[TieredKVCache, HiSparseServing]:
        cache = TieredKVCache(self.config)
        # Logical ids must differ from device slots (else an untranslated id goes unseen).
        assert cache.allocator.logical_allocator.alloc(3 * PAGE) is not None
        cache._initial = cache.free_sizes()
        inject(cache, self.faults, engine=False)
        break_prefix_copies(cache.host_pool, self.faults)
        return cache, HiSparseServing(cache, BUFFER, copy_mode=self.copy_mode)

    # -- the oracle -----------------------------------------------------------------------------
    def wrong(self, bad: torch.Tensor, what: str, live: Live) -> None:
        self.n["checked"] += bad.numel()
        wrong = int(bad.sum())
        if wrong:
            self.n["wrong"] += wrong
            self.first_wrong = self.first_wrong or (
                f"{wrong}/{bad.numel()} rows wrong {what} (positions "
                f"{bad.nonzero().flatten()[:8].tolist()}, prefix {live.req.prefix_len}, "
                f"hits {live.req.hits}, ops {self.n}, counts {self.serving.counts})"
            )

    def check_staged(self, live: Live, end: int, what: str) -> None:
        """Positions ``[0, end)`` at the staging rows (latent and indexer rows). A sparse
        request reads the pool's buffers as they are: it has no layer-wise load to follow (the
        getters would wait on the last dense forward's, failed or not)."""
        if end == 0:
            return
        self.model.identity = live.extra
        pool, rows = self.serving.pool, live.req.staging[:end]
        k = torch.stack([pool.kv_buffer[i][rows] for i in range(LAYERS)])
        v = torch.stack([pool.index_k_with_scale_buffer[i][rows] for i in range(LAYERS)])
        ek, ev = self.model.expected(live.req.tokens, 0, end)
        self.wrong(differs(k, ek) | differs(v, ev), what, live)

    def check_decode(self, live: Live) -> None:
        """Random layers: a random selection swapped in, its rows at the returned slots; every
        position's scored indexer key."""
        req, rng, pool = live.req, self.rng, self.serving.pool
        self.model.identity = live.extra
        n = len(req.tokens)
        ek, ev = self.model.expected(req.tokens, 0, n)
        newest = n - 1 if live.pending else None
        others = [p for p in range(n) if p != newest]
        for layer in rng.sample(range(LAYERS), rng.randint(1, LAYERS)):
            picked = rng.sample(others, rng.randint(1, min(BUFFER, len(others))))
            if newest is not None and rng.random() < 0.5:
                picked.append(newest)
            todo = torch.tensor(picked, dtype=torch.int64)
            for _ in range(SWAP_TRIES):
                got = self.serving.swap_in(req, layer, todo)
                self.n["swap_calls"] += 1
                self.n["swap_loaded"] += got.loaded
                self.n["swap_failed"] += got.failed.numel()
                assert got.hits + got.loaded + got.failed.numel() == todo.numel(), got
                ok = ~torch.isin(todo, got.failed)
                assert not bool(got.device_slots[~ok].any()), "a failed position reads a row"
                rows = pool.kv_buffer[layer][got.device_slots[ok]]
                self.wrong(differs(rows[None], ek[layer, todo[ok]][None]), "swapped in", live)
                if not got.failed.numel():
                    break
                todo = got.failed
            else:
                self.n["swap_gave_up"] += 1
            keys = self.serving.score_keys(req, layer)
            want = dequantize_index_k(ev[layer], self.model.index_dim)
            self.n["scored"] += n
            self.wrong(differs(keys[None], want[None]), "scored", live)

    # -- operations -----------------------------------------------------------------------------
    def new_prompt(self) -> tuple[list[int], object]:
        rng = self.rng
        if self.prompts and rng.random() < 0.45:  # served again, most often a recent one
            return rng.choice(self.prompts[-10:] if rng.random() < 0.7 else self.prompts)
        fresh = [rng.randrange(50_000) for _ in range(rng.randint(2, MAX_PROMPT))]
        extra = rng.choice(IDENTITIES)
        if self.prompts and rng.random() < 0.75:  # a random-length prefix of an earlier prompt
            base, extra = rng.choice(self.prompts)
            fresh = base[: rng.randint(1, len(base))] + fresh
            extra = extra if rng.random() < 0.8 else rng.choice(IDENTITIES)
        self.prompts.append((fresh[:MAX_PROMPT], extra))
        return self.prompts[-1]

    def begin(self) -> None:
        prompt, extra = self.new_prompt()
        req = self.serving.begin(prompt, extra)
        if req is None:
            self.n["refused"] += 1
            return
        h = req.hits
        assert h.device + h.host + h.storage + h.missed == len(prompt) and h.missed >= 1, h
        assert req.prefix_len == h.device + h.host + h.storage and req.prefix_len % PAGE == 0
        assert req.tokens == prompt and len(req.staging) == len(prompt)
        self.n["begins"] += 1
        for t in self.tiers:
            self.tiers[t] += getattr(h, t)
        if self.n["restarts"]:
            self.storage_after_restart += h.storage
        live = Live(req, extra, self.rng.randint(0, MAX_DECODE))
        self.live.append(live)
        self.check_staged(live, req.prefix_len, "after begin")

    def prefill(self, live: Live) -> None:
        """The model's writes of the prompt after the prefix: through the facade at the
        logical ids, or at the staging rows of the pool."""
        req, pool = live.req, self.serving.pool
        self.model.identity = live.extra
        p, n = req.prefix_len, len(req.tokens)
        k, v = self.model.produced(req.tokens, p, n)
        for layer in range(LAYERS):
            if self.rng.random() < 0.5:
                self.cache.write_kv(layer, req.logical[p:], k[layer], None)
                self.cache.write_index_k(layer, req.logical[p:], v[layer])
            else:
                pool.set_kv_buffer(layer, req.staging[p:], k[layer], None)
                pool.set_index_k_buffer(layer, req.staging[p:], v[layer])
        live.computed = True

    def decode(self, live: Live) -> None:
        req, pool = live.req, self.serving.pool
        slot = self.serving.begin_token(req, self.rng.randrange(50_000))
        if slot is None:
            self.n["token_refused"] += 1
            return
        live.decode_left -= 1
        live.decoded = live.pending = True
        self.model.identity = live.extra
        pos = len(req.tokens) - 1
        k, v = self.model.produced(req.tokens, pos, pos + 1)
        for layer in range(LAYERS):
            if self.rng.random() < 0.5:
                self.cache.write_kv(layer, req.logical[-1:], k[layer], None)
                self.cache.write_index_k(layer, req.logical[-1:], v[layer])
            else:
                pool.set_kv_buffer(layer, slot, k[layer], None)
                pool.set_index_k_buffer(layer, slot, v[layer])
        self.check_decode(live)
        live.pending = not self.serving.commit_token(req)
        if self.rng.random() < 0.3:
            self.check_decode(live)

    def advance(self, live: Live) -> None:
        req, rng = live.req, self.rng
        if req.swapper is None:  # staged: prefill, then admit (again, after a failed one)
            if not live.computed:
                self.prefill(live)
                if rng.random() < 0.5:
                    self.check_staged(live, len(req.tokens), "before admit")
            if self.serving.admit(req) and rng.random() < 0.5:
                self.check_decode(live)
        elif live.pending and (live.decode_left or rng.random() < 0.8):
            live.pending = not self.serving.commit_token(req)
        elif live.decode_left:
            self.decode(live)
        else:  # now and then with its last token's commit still failed (not inserted)
            self.finish(live)

    def finish(self, live: Live) -> None:
        self.check_decode(live)
        self.serving.finish(live.req)
        self.live.remove(live)
        if live.decoded or self.rng.random() < 0.3:  # its decoded tokens are cached too
            self.prompts.append((live.req.tokens[:MAX_PROMPT], live.extra))

    def abort(self, live: Live) -> None:
        self.serving.abort(live.req)
        self.live.remove(live)

    def dense(self) -> None:
        """A dense request served at once (its nodes may stay device-only: a later sparse
        begin writes them to host); faults surface as its prefix load's errors: aborted."""
        prompt, extra = self.new_prompt()
        cache = self.cache
        self.model.identity = extra
        if cache.req_to_token.available_size() == 0:
            return
        req = cache.begin(prompt, extra_key=extra)
        try:
            cache.prepare_forward(req)
            self.model.compute(req, prompt[req.prefix_len :])
        except (StateError, TransferError):  # the failed load, acknowledged or read
            self.n["dense_failed"] += 1
            cache.abort(req)
            return
        cache.finish(req)
        self.n["dense"] += 1

    def step(self) -> None:
        rng, cache = self.rng, self.cache
        r = rng.random()
        if r < 0.18 and len(self.live) < MAX_LIVE:
            self.begin()
        elif r < 0.21:
            self.dense()
        elif r < 0.88 and self.live:
            live = rng.choice(self.live)
            if rng.random() < 0.04:
                self.abort(live)
            else:
                self.advance(live)
        elif r < 0.93:
            cache.poll()
        elif r < 0.95:
            cache.drain()
        elif r < 0.97:  # host pressure: host-only nodes go down to storage (or away)
            cache.manager.evict_host(rng.randint(8, 96))
        elif r < 0.99:  # device pressure: the dense requests' device copies go
            cache.manager.evict_device(rng.randint(8, 96))
        elif r < 0.993:  # everything unlocked goes (the live prefixes are protected on host)
            cache.clear_tree()
        elif r < 0.997:
            self.restart()

    def settle(self) -> None:
        """Finish or abort every live request; then every slot and row must be back."""
        while self.live:
            live = self.live[0]
            if self.rng.random() < 0.3:
                self.abort(live)
            else:
                self.advance(live)
        cache = self.cache
        assert not self.serving.live
        cache.drain()
        cache.manager.check_integrity()
        cache.clear_tree()
        cache.manager.check_integrity()
        assert cache.free_sizes() == cache._initial, (cache.free_sizes(), cache._initial)
        assert cache.stats()["occupancy"] == {"device_tokens": 0, "host_tokens": 0}

    def restart(self) -> None:
        self.settle()
        self.add_counts()
        self.cache.close()
        self.cache, self.serving = self._open()
        self.model.cache = self.cache
        self.n["restarts"] += 1

    def missing(self, tight: bool) -> list[str]:
        """What the test's liveness asserts ask for and has not happened yet."""
        counts = {k: self.counts.get(k, 0) + v for k, v in self.serving.counts.items()}
        need = ("prefix_load_failed", "admit_failed", "commit_failed", "finished", "aborted")
        out = [k for k in need if not counts.get(k)]
        points = ("load_to_device_all", "backup_from_device", "swap_in_load")
        out += [p for p in points if not self.faults.fired.get(p)]
        out += [k for k in ("swap_loaded", "swap_failed", "restarts") if not self.n[k]]
        if not self.tiers["host"] or not self.storage_after_restart:
            out.append("host and storage hits")
        if tight and not self.n["refused"]:
            out.append("refused")
        return out

    def add_counts(self) -> None:
        for k, v in self.serving.counts.items():
            self.counts[k] = self.counts.get(k, 0) + v


@pytest.mark.parametrize(
    ("write_policy", "host_layout", "tight"),
    [
        (WritePolicy.WRITE_THROUGH.value, "layer_first", False),
        (WritePolicy.WRITE_BACK.value, "page_first", False),
        (WritePolicy.WRITE_THROUGH_SELECTIVE.value, "page_first_direct", True),
    ],
)
def test_hisparse_fault_campaign_serves_only_exact_rows(
    tmp_path, gen, monkeypatch, write_policy, host_layout, tight
):
    seed = campaign_seed(gen)
    print(f"hisparse campaign seed {seed} (TIERED_KV_CAMPAIGN_SEED={seed})")
    c = SparseCampaign(tmp_path, seed, write_policy, host_layout, tight)
    break_swap_in(monkeypatch, c.faults)
    print(f"io backend {c.config.host.io_backend}, copy mode {c.copy_mode}")
    try:
        # Past OPS, keep stepping (bounded) until what the asserts below ask for has come.
        steps = 0
        while steps < OPS or (steps < 4 * OPS and c.missing(tight)):
            if steps == OPS // 2 and not c.n["restarts"]:
                c.restart()  # at least one: later prefixes come from storage
            c.step()
            steps += 1
        c.settle()
        c.add_counts()
    finally:
        c.cache.close()
    fired = c.faults.fired
    print(f"ops {steps}, {c.n}, tier hits {c.tiers}, storage after restart "
          f"{c.storage_after_restart}, counts {c.counts}, faults {fired}")  # fmt: skip
    assert c.n["wrong"] == 0, c.first_wrong
    assert c.n["checked"] > 0 and c.n["begins"] > OPS // 20, c.n
    assert c.n["swap_loaded"] and c.n["swap_failed"] and c.n["restarts"], c.n
    assert c.tiers["host"] and c.storage_after_restart, (c.tiers, c.storage_after_restart)
    for point in ("load_to_device_all", "backup_from_device", "swap_in_load"):
        assert fired.get(point), (point, fired)
    assert sum(n for point, n in fired.items() if "batch_" in point), fired
    for name in ("begun", "prefix_load_failed", "admitted", "admit_failed", "commit_failed"):
        assert c.counts[name], (name, c.counts)
    assert c.counts["finished"] and c.counts["aborted"] and c.counts["inserted_tokens"], c.counts
    if tight:  # begins found the device or host short (counted, nothing held)
        assert c.n["refused"], c.n


def test_a_sparse_token_is_scored_after_a_dense_load_failed(tmp_path):
    """The campaign's first find: a dense request's failed layer-wise load left the device
    pool's layer waits pointing at it, and ``score_keys`` of a sparse request's newest token
    read its row through the pool's getter, which waited on that load and raised its error."""
    c = SparseCampaign(tmp_path, 5, WritePolicy.WRITE_THROUGH.value, "layer_first")
    cache, host = c.cache, c.cache.host_pool
    c.faults.rate = 0.0
    prompt = list(range(100, 121))
    try:
        c.model.identity = None
        req = cache.begin(prompt)
        c.model.compute(req, prompt)
        cache.finish(req)
        cache.drain()
        cache.manager.evict_device(1 << 20)  # the next dense begin loads from host

        calls = []

        def fail(*args, **kwargs):
            calls.append(args)
            raise InjectedCopyFault("load_to_device_per_layer")

        host.load_to_device_per_layer = fail
        req = cache.begin(prompt)
        assert req.prefix_len
        with contextlib.suppress(StateError):  # raised once the failed load is acknowledged
            cache.prepare_forward(req)
        cache.drain()
        assert calls
        cache.abort(req)
        live = Live(c.serving.begin(list(range(200, 211))), None, 1)
        c.prefill(live)
        assert c.serving.admit(live.req)
        c.decode(live)  # scores its newest token (and checks every row)
        assert c.n["wrong"] == 0 and c.n["scored"], c.n
        c.serving.finish(live.req)
    finally:
        cache.close()
