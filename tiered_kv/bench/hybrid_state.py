"""A hybrid model's cached prefix against the same model with every layer full attention: the
bytes it holds on each tier and the time to make it usable again, through ``TieredKVCache``.

The two caches share one geometry (:class:`Shape`); in the hybrid one layer in ``full_every`` is
full attention and the others recurrent, each with a fixed-size state per request (a conv
history and a temporal state, float32), so its prefix holds ``tokens x full-layer KV`` plus one
state snapshot, where the other holds ``tokens x every layer's KV``. No model runs: a prompt is
begun and extended, random bits are written through ``write_kv`` for every full layer (and into
the request's state slot, tracked at the prompt's last page boundary), and the request finishes
(``cache_prefix``). Write-through then leaves the prefix on every tier.

``prefix_bytes`` reads what each tier holds from the tiers themselves (the tree's occupancy times
each pool's bytes per token, the ledger's snapshot slots times their size, the store's own stats).
``restore`` times ``begin`` of the prompt plus one token until every full layer's buffers are
readable (the pool's getters wait for the layer loads), with the prefix left on the device, on
host only (``evict_device``) or in the store only (``clear_tree``), and checks after each timing
that the whole prefix hit that tier, that a few layers' K and V and the whole restored state are
the bytes written (``verify.fail`` otherwise).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from tiered_kv.bench import machine, timing, verify
from tiered_kv.cache import TieredKVCache
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import Tier

# Device first: a snapshot restored from host or the store stays there, not on the device.
TIERS = (Tier.DEVICE, Tier.HOST, Tier.STORAGE)


@dataclass(frozen=True)
class Shape:
    """The model both caches are built for; ``full_every`` applies to the hybrid only."""

    layers: int = 16
    heads: int = 8  # KV heads
    head_dim: int = 128
    dtype: str = "bfloat16"
    page_size: int = 64
    full_every: int = 4
    conv_kernel: int = 4
    linear_heads: int = 16
    key_dim: int = 128
    value_dim: int = 128

    @property
    def full_layers(self) -> int:
        """The hybrid's full-attention layers (layer i when (i + 1) % full_every == 0)."""
        return self.layers // self.full_every

    def describe(self) -> str:
        full = self.full_layers
        return (
            f"{self.layers} layers, {self.heads} KV heads x {self.head_dim}, {self.dtype}, page "
            f"{self.page_size}; hybrid: {full} full-attention layers (1 in {self.full_every}) "
            f"and {self.layers - full} recurrent ({self.linear_heads} heads, key {self.key_dim}, "
            f"value {self.value_dim}, conv kernel {self.conv_kernel}, state float32)"
        )


def config(shape: Shape, hybrid: bool, tokens: int, store_dir: str) -> TieredKVConfig:
    """A cache that holds one prefix of ``tokens`` on every tier, and its restore."""
    ps = shape.page_size
    room = tokens + 2 * ps
    kv = tokens * shape.layers * 2 * shape.heads * shape.head_dim * 4  # at most 4-byte elements
    extra = {}
    if hybrid:
        extra = dict(
            model="hybrid_linear", full_layer_every=shape.full_every,
            conv_kernel=shape.conv_kernel, linear_heads=shape.linear_heads,
            linear_key_dim=shape.key_dim, linear_value_dim=shape.value_dim,
            state_snapshot_every=0, device_state_slots=8, host_state_slots=4,
        )  # fmt: skip
    return TieredKVConfig.flat(
        num_layers=shape.layers, head_num=shape.heads, head_dim=shape.head_dim,
        dtype=shape.dtype, page_size=ps, device_tokens=room, host_tokens=room, max_requests=2,
        max_context_len=room, storage_bytes=kv + (256 << 20), storage_path=store_dir,
        model_id="bench-hybrid-state@1", prefetch_policy="wait_complete",
        prefetch_threshold=ps, **extra,
    )  # fmt: skip


@dataclass
class Prefix:
    """One cached prefix and the bytes written for it (kept for a few layers only)."""

    cache: TieredKVCache
    prompt: list[int]
    full_layers: list[int]
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    state: list[torch.Tensor] = field(default_factory=list)  # conv per layer, then temporal

    @property
    def hybrid(self) -> bool:
        return self.cache.states is not None

    def close(self) -> None:
        self.cache.close()


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    verify.int_view(t).random_(generator=gen)  # every bit pattern, NaN and inf included
    return t


def _state_rows(cache: TieredKVCache, slot: int) -> list[torch.Tensor]:
    pool = cache.req_to_token.mamba_pool
    return [c[slot] for c in pool.conv] + [pool.temporal[:, slot]]


def cache_prefix(
    shape: Shape, hybrid: bool, tokens: int, store_dir: str, gen: torch.Generator
) -> Prefix:
    """A new cache holding one prefix of ``tokens`` (a multiple of the page size) on every tier."""
    cache = TieredKVCache(config(shape, hybrid, tokens, store_dir))
    try:
        g = cache.config.geometry
        full = g.hybrid_layer_ids()[0] if hybrid else list(range(g.num_layers))
        prompt = torch.randint(1, 50_000, (tokens,), generator=gen).tolist()
        p = Prefix(cache, prompt, full)
        checked = {full[0], full[len(full) // 2], full[-1]}
        req = cache.begin(prompt)
        slots = cache.extend(req, prompt[req.prefix_len :])
        item = (tokens, g.head_num, g.head_dim)
        for layer in full:
            k, v = _random(item, g.torch_dtype, gen), _random(item, g.torch_dtype, gen)
            cache.write_kv(layer, slots, k, v)
            if layer in checked:
                p.kv[layer] = (k, v)
        if hybrid:
            for row in _state_rows(cache, req.kv.mamba_pool_idx):
                row.copy_(_random(tuple(row.shape), row.dtype, gen))
                p.state.append(row.clone())
            cache.track_state(req, tokens)  # the state after the prompt's last whole page
        cache.finish(req)
        cache.drain()  # write-through: the host copy and the store's pages
        return p
    except BaseException:
        cache.close()
        raise


class TierBytes(NamedTuple):
    """Bytes one tier holds for a prefix: all of them, and the recurrent state's part."""

    total: int
    state: int


def prefix_bytes(p: Prefix) -> dict[Tier, TierBytes]:
    """Per tier, the bytes the cache holds for ``p``; fails unless each tier holds the whole
    prefix (and, for the hybrid, exactly one snapshot of its state). Storage: the store's own
    accounting (whole disk blocks and an index entry per value); its state part is the stored
    snapshot's value bytes."""
    c, n = p.cache, len(p.prompt)
    ps = c.config.page_size
    pool = c.device_pool
    device_token = sum(
        b[0].numel() * b.element_size()
        for layer in p.full_layers
        for b in (pool.get_key_buffer(layer), pool.get_value_buffer(layer))
    )
    host_token = c.host_pool.page_nbytes // ps
    if c.tree.device_tokens != n or c.tree.host_tokens != n:
        verify.fail(
            "prefix bytes",
            f"the device holds {c.tree.device_tokens} and the host {c.tree.host_tokens} tokens "
            f"of a {n}-token prefix",
        )
    state = dict.fromkeys(TIERS, 0)
    stored = 0
    if p.hybrid:
        ledger = c.states.ledger
        counts = (len(ledger.device_slots()), len(ledger.host_slots()))
        stored = sum(s.stored for s in ledger.snaps.values())
        if counts != (1, 1) or stored != 1:
            verify.fail(
                "prefix bytes",
                f"expected one state snapshot per tier; device {counts[0]}, host {counts[1]}, "
                f"stored {stored}",
            )
        state = {
            Tier.DEVICE: ledger.pool.slot_nbytes,
            Tier.HOST: ledger.host.slot_nbytes,
            Tier.STORAGE: ledger.host.page_nbytes,
        }
    # The KV pages and the state values share one store directory (one index and budget, a
    # namespace each), so its figures cover both.
    store = c.storage.stats()
    if store.pages != n // ps + stored:
        verify.fail(
            "prefix bytes",
            f"the store holds {store.pages} values; expected {n // ps} KV pages and {stored} "
            "state snapshots",
        )
    return {
        Tier.DEVICE: TierBytes(n * device_token + state[Tier.DEVICE], state[Tier.DEVICE]),
        Tier.HOST: TierBytes(n * host_token + state[Tier.HOST], state[Tier.HOST]),
        Tier.STORAGE: TierBytes(store.bytes, state[Tier.STORAGE]),
    }


def _evict_to(p: Prefix, tier: Tier) -> None:
    """Leave the prefix on ``tier`` as its fastest copy."""
    c = p.cache
    c.drain()
    if tier is Tier.HOST:
        c.manager.evict_device(1 << 62)  # the host copy stays (write-through)
        c.drain()
    elif tier is Tier.STORAGE:
        c.clear_tree()  # every memory tier; the store keeps its pages and the snapshot


def _check(p: Prefix, req, tier: Tier, restored_before: int) -> None:
    c, n = p.cache, len(p.prompt)
    where = f"{'hybrid' if p.hybrid else 'full'} restore from {tier.value}, {n} tokens"
    if req.prefix_len != n or getattr(req.hits, tier.value) != n:
        verify.fail(where, f"prefix {req.prefix_len} tokens, hits {req.hits}; expected {n}")
    idx = req.slots[:n].to(torch.int64)
    pool = c.device_pool
    for layer, (k, v) in p.kv.items():
        for name, buf, want in (
            ("K", pool.get_key_buffer(layer), k),
            ("V", pool.get_value_buffer(layer), v),
        ):
            got = buf[idx]
            if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                bad = verify.first_bad_rows(verify.int_view(got), verify.int_view(want))
                verify.fail(
                    where,
                    f"layer {layer} {name}: {len(bad)} tokens differ, first {bad[:4].tolist()}",
                )
    if p.hybrid:
        restored = getattr(c.states.counts, f"restored_{tier.value}")
        if restored != restored_before + 1:
            verify.fail(where, f"the state was not restored from {tier.value} (counter {restored})")
        rows = _state_rows(c, req.kv.mamba_pool_idx)
        for i, (got, want) in enumerate(zip(rows, p.state, strict=True)):
            if not torch.equal(verify.int_view(got), verify.int_view(want)):
                part = "temporal" if i == len(rows) - 1 else f"conv of recurrent layer {i}"
                verify.fail(where, f"restored state differs ({part})")


def restore(p: Prefix, tier: Tier) -> float:
    """Seconds from ``begin`` of the prompt plus one token, with the prefix left on ``tier``,
    until every full layer's K and V buffers are readable; checked afterwards (untimed)."""
    _evict_to(p, tier)
    c = p.cache
    pool = c.device_pool
    before = getattr(c.states.counts, f"restored_{tier.value}") if p.hybrid else 0

    def usable():
        req = c.begin([*p.prompt, 1])
        for layer in p.full_layers:  # each getter waits for its layer's load
            pool.get_key_buffer(layer)
            pool.get_value_buffer(layer)
        return req

    seconds, req = timing.timed_call(usable, collect=True)
    try:
        c.drain()
        _check(p, req, tier, before)
    finally:
        c.abort(req)
    return seconds


class Row(NamedTuple):
    """One prefix length and tier: the two models' bytes and restore times (medians)."""

    tokens: int
    tier: str  # a Tier value
    hybrid_bytes: int
    full_bytes: int
    hybrid_state_bytes: int
    hybrid_ms: float
    full_ms: float
    hybrid_samples_ms: list[float]
    full_samples_ms: list[float]
    noise: tuple[str, ...]

    @property
    def bytes_ratio(self) -> float:
        return self.full_bytes / self.hybrid_bytes

    @property
    def ms_ratio(self) -> float:
        return self.full_ms / self.hybrid_ms if self.hybrid_ms > 0 else float("inf")


def measure(shape: Shape, tokens: int, repeats: int, workdir: str, seed: int) -> list[Row]:
    """Both caches for one prefix length; per tier, their bytes and restore times, the two
    models round-robin (one warm-up round), every restore checked."""
    if tokens % shape.page_size:
        raise InvalidArgumentError(
            f"tokens={tokens} must be a multiple of page_size={shape.page_size}"
        )
    gen = torch.Generator().manual_seed(seed)
    prefixes = {}
    try:
        for name, hybrid in (("hybrid", True), ("full", False)):
            store = os.path.join(workdir, f"{name}-{tokens}")
            prefixes[name] = cache_prefix(shape, hybrid, tokens, store, gen)
        held = {name: prefix_bytes(p) for name, p in prefixes.items()}
        rows = []
        for tier in TIERS:
            arms = {name: (lambda _, p=p, t=tier: restore(p, t)) for name, p in prefixes.items()}
            got = timing.interleave(arms, repeats, warmup=1, rotate=True)
            ms = {name: [s * 1e3 for s in got[name]] for name in got}
            noise = machine.noise_check(ms["full"]).reasons
            rows.append(
                Row(
                    tokens, tier.value, held["hybrid"][tier].total, held["full"][tier].total,
                    held["hybrid"][tier].state, timing.median(ms["hybrid"]),
                    timing.median(ms["full"]), ms["hybrid"], ms["full"], noise,
                )
            )  # fmt: skip
        return rows
    finally:
        for p in prefixes.values():
            p.close()
