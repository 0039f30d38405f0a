"""A stand-in model the :class:`~tiered_kv.engine.scheduler.Scheduler` drives at real model
scale: no weights, no arithmetic, real KV bytes, a modeled clock.

``SyntheticModel.forward`` has the signature the scheduler calls (``tokens, start, kv,
chunk``): it writes the KV of the new positions with :class:`SyntheticKV` through the cache
(the bytes a model of the preset's geometry would hold, a function of each token's prefix),
a page at a time once its last token is forwarded (only whole pages are ever cached), and
returns one row of fake logits whose argmax is a hash of the last tokens and the position
(deterministic, so every run of a workload decodes the same tokens). It is the cache's
verifier (``cache.verify``): before a request's first forward it calls ``verify_restored``,
and for the restored prefixes the cache samples (``verify_fraction``) it checks the bytes, from
whichever tier they came (``SyntheticKV.mismatched``), and counts the mismatched tokens: 0 when
every checked restore was exact. A wrong page is quarantined by the cache and the request
writes its KV again from where it was cut back. An ``on_restored`` hook runs just before each
check (the negative control corrupts a byte there).

No compute happens, so time is *modeled*: :class:`ModeledClock` charges each scheduler step
the :class:`~tiered_kv.engine.cost_model.CostModel`'s prefill time for the tokens actually
computed, its decode time for the batch (and the KV it reads), and the loads of the step's
restored prefixes at the stated :class:`LinkModel` bandwidths. The prefill time a real
engine's live verification would spend (each checked prefix recomputed, and what a cut took
back) is modeled apart (``verify_s``), not added to the clock: the synthetic check costs no
compute, and the run's times stay those of serving. Measured transfer seconds on
this machine are a CPU memcpy and a local disk, not an accelerator's links, so they are
reported next to the modeled time, never added to it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tiered_kv.cache import Request, TieredKVCache
from tiered_kv.engine.batch_state import StepResult
from tiered_kv.engine.cost_model import CostModel
from tiered_kv.engine.kv_bytes import KVBytes
from tiered_kv.engine.serve import PagedKV
from tiered_kv.engine.synthetic_kv import SyntheticKV
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import Direction
from tiered_kv.transfer.stats import DirectionStats

VOCAB_SIZE = 32_000
_CONTEXT = 8  # the next token hashes this many last tokens and the position
_SEEN = "synthetic_checked"  # Request.extra keys: its restored prefix was verified,
_WRITTEN = "synthetic_written"  # and the positions below this hold their KV
_LINKS = (Direction.HOST_TO_DEVICE, Direction.STORAGE_TO_HOST)


@dataclass(frozen=True)
class _Embed:
    dtype: torch.dtype  # the scheduler builds PagedKV with ``model.embed.dtype``


@dataclass
class LoadedTokens:
    """Restored prefix tokens whose loads a step waited for, by the tier they came from."""

    host: int = 0
    storage: int = 0
    # The bytes those restores move (``KVBytes.restored``: a window's KV and a hybrid's state
    # snapshot included; a storage hit's, the prefix's end, carries the snapshot). 0: tokens x
    # the clock's bytes per token.
    host_bytes: int = 0
    storage_bytes: int = 0
    # Tokens verification made the engine compute: a sampled prefix recomputed to compare, and
    # what a cut took back (charged as prefill: ``ModeledClock.verify_s``).
    verify: int = 0


class SyntheticModel:
    """Writes synthetic KV for what the scheduler computes; verifies the restored prefixes the
    cache samples (its verifier).

    ``write=False`` skips the KV writes (a baseline whose KV nothing ever reads, as a run
    with no prefix reuse); verification then has nothing to check. Counters: ``restores``
    (requests begun with a cached prefix), ``verified_tokens``, ``mismatched_tokens``,
    ``computed_tokens`` (positions forwarded)."""

    def __init__(
        self,
        cache: TieredKVCache,
        kv: SyntheticKV,
        *,
        write: bool = True,
        on_restored: Callable[[TieredKVCache, Request], None] | None = None,
    ) -> None:
        if not isinstance(kv, SyntheticKV):
            raise InvalidArgumentError(f"kv must be a SyntheticKV, got {type(kv).__name__}")
        self.cache, self.kv, self.write, self.on_restored = cache, kv, write, on_restored
        self.embed = _Embed(kv.dtype)
        self.page_size = cache.config.page_size
        self.bytes = KVBytes(cache.config.geometry, self.page_size)
        self.restores = self.verified_tokens = self.mismatched_tokens = 0
        # What the restores from host and storage moved, and would move with every layer full
        self.restored_tokens = self.restored_bytes = self.all_full_restored_bytes = 0
        self.computed_tokens = self.recomputed_tokens = 0
        if write:  # else nothing ever reads the KV (and none is written to check)
            cache.set_verifier(self._verify)
        self.loaded = LoadedTokens()  # since the last ``take_loaded``

    def forward(
        self, tokens: torch.Tensor, start: int, kv: PagedKV, chunk: int, *, on_boundary=None
    ) -> torch.Tensor:
        """Forward positions ``start .. start + len(tokens) - 1`` of ``kv.req`` (their slots
        already allocated by ``extend``): the KV of every page they complete is written;
        (1, VOCAB_SIZE) logits for the last position. The first call for a request first
        verifies its restored prefix (``0 .. start``). ``chunk`` is unused (no arithmetic);
        ``on_boundary`` too: a hybrid's state is tracked by ``SyntheticKV.write`` itself."""
        req = kv.req
        end = start + len(tokens)
        if end != len(req.tokens):
            raise InvalidArgumentError(
                f"forward of positions {start}..{end} but the request holds {len(req.tokens)}"
            )
        if not req.extra.get(_SEEN):
            req.extra[_SEEN] = True
            self._check_restored(req, start)
        # Only whole pages are ever cached (``finish`` frees a partial last page), so a page's
        # KV is written once its last token is forwarded: one write per page, not per token.
        written = req.extra.get(_WRITTEN, start)
        full = end - end % self.page_size
        if self.write and full > written:
            self.kv.write(self.cache, req, written, full, kept_only=True)
            req.extra[_WRITTEN] = full
        self.computed_tokens += end - start
        logits = torch.zeros(1, VOCAB_SIZE)
        logits[0, next_token(req.tokens, end)] = 1.0
        return logits

    def _check_restored(self, req: Request, start: int) -> None:
        hits = req.hits
        self.loaded.host += hits.host
        self.loaded.storage += hits.storage
        restored = hits.host + hits.storage
        if restored:
            prefix = hits.device + restored
            moved = self.bytes.restored(prefix, restored)
            stored = self.bytes.restored(prefix, hits.storage)  # the prefix's end, its state
            self.loaded.host_bytes += moved - stored
            self.loaded.storage_bytes += stored
            self.restored_tokens += restored
            self.restored_bytes += moved
            self.all_full_restored_bytes += self.bytes.all_full_restored(restored)
        if req.prefix_len == 0:
            return
        self.restores += 1
        cache = self.cache
        if len(req.tokens) > req.prefix_len and (
            cache.states is not None or cache.manager.window is not None
        ):
            # The scheduler extends before the first forward, and the cache can only cut a
            # hybrid or sliding-window request back before it (its state and window KV would
            # have to be taken back too): check the bytes here, counted, not quarantined.
            if self.write and cache.verifier.sample():
                self._verify(req)
            return
        if not cache.verify_restored(req):  # cut back: its KV is written from there
            req.extra[_WRITTEN] = req.prefix_len
            self.recomputed_tokens += start - req.prefix_len
            self.loaded.verify += start - req.prefix_len

    def _verify(self, req: Request) -> torch.Tensor:
        """The cache's verifier: which restored prefix tokens hold other bytes than ours."""
        if self.on_restored is not None:
            self.on_restored(self.cache, req)
        bad = self.kv.mismatched(self.cache, req)
        self.mismatched_tokens += int(bad.sum())
        self.verified_tokens += req.prefix_len
        self.loaded.verify += req.prefix_len  # a real engine recomputes the prefix to compare
        return bad

    def take_loaded(self) -> LoadedTokens:
        """The loads counted since the last call (and reset them)."""
        out, self.loaded = self.loaded, LoadedTokens()
        return out


def next_token(tokens: list[int], end: int) -> int:
    """The token the fake logits choose after ``tokens[:end]``: a hash of the last
    ``_CONTEXT`` tokens and the position (never 0)."""
    tail = np.asarray([end, *tokens[max(0, end - _CONTEXT) : end]], dtype="<u8").tobytes()
    h = int.from_bytes(hashlib.blake2b(tail, digest_size=8).digest(), "little")
    return 1 + h % (VOCAB_SIZE - 1)


@dataclass(frozen=True)
class LinkModel:
    """Modeled bandwidths of the links a restored prefix crosses (bytes/s): host -> device
    and storage -> host (a storage hit crosses both)."""

    name: str = "pcie5-nvme4"
    host_to_device_bytes_per_s: float = 25e9
    storage_to_host_bytes_per_s: float = 6e9
    source: str = (
        "modeled: PCIe 5.0 x16 (64 GB/s raw) at ~40% for layer-wise pinned copies = 25 GB/s; "
        "one NVMe 4.0 x4 drive's ~7 GB/s sequential read at ~85% = 6 GB/s"
    )

    def __post_init__(self) -> None:
        for name in ("host_to_device_bytes_per_s", "storage_to_host_bytes_per_s"):
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            if not ok or not math.isfinite(v) or v <= 0:
                raise InvalidArgumentError(f"LinkModel.{name}={v!r} must be a finite number > 0")

    def link_loads(
        self, loaded: LoadedTokens, bytes_per_token: int
    ) -> tuple[tuple[Direction, int, float], ...]:
        """(direction, bytes, modeled seconds) on each link ``loaded`` crosses (its bytes, or
        where it gives none its tokens x ``bytes_per_token``)."""
        host = loaded.host_bytes or loaded.host * bytes_per_token
        to_host = loaded.storage_bytes or loaded.storage * bytes_per_token
        to_device = host + to_host
        return (
            (Direction.HOST_TO_DEVICE, to_device, to_device / self.host_to_device_bytes_per_s),
            (Direction.STORAGE_TO_HOST, to_host, to_host / self.storage_to_host_bytes_per_s),
        )

    def load_s(self, loaded: LoadedTokens, bytes_per_token: int) -> float:
        return sum(seconds for _, _, seconds in self.link_loads(loaded, bytes_per_token))


class ModeledClock:
    """Modeled seconds since the run began, advanced once per scheduler step (every value
    here is modeled, never measured: ``CostModel.label``)."""

    def __init__(self, cost: CostModel, links: LinkModel, bytes_per_token: int) -> None:
        self.cost, self.links, self.bytes_per_token = cost, links, bytes_per_token
        self.now = 0.0
        self.prefill_s = self.decode_s = self.load_s = self.verify_s = 0.0
        self.step_end: list[float] = []  # the clock at the end of each step
        self.idle_steps = 0  # steps that ran nothing (waiting for copies): not charged
        # Modeled bytes and seconds per link, one op per step that loads (a load planner's
        # observations in a run where the links are modeled: ``link_stats``).
        self._moved = {d: DirectionStats() for d in _LINKS}

    def advance(
        self,
        step: StepResult,
        loaded: LoadedTokens,
        decode_context_tokens: int,
        decode_kv_bytes: int | None = None,
    ) -> float:
        """Charge one step: its computed prompt tokens, one decode step of its decoded batch
        reading ``decode_context_tokens`` tokens of KV (``decode_kv_bytes`` when given: a
        window's or a state's bytes are not per token), and its loads; the prefill of what its
        verification recomputed (``loaded.verify``) goes to ``verify_s``, not onto the clock.
        Returns the new time."""
        self.idle_steps += not (step.admitted or step.prefilled_tokens or step.decoded)
        prefill = self.cost.prefill_s(step.prefilled_tokens)
        decode = 0.0
        if step.decoded:
            kv_bytes = decode_kv_bytes
            if kv_bytes is None:
                kv_bytes = decode_context_tokens * self.bytes_per_token
            decode = self.cost.decode_s(len(step.decoded), kv_bytes)
        load = self.links.load_s(loaded, self.bytes_per_token)
        for direction, nbytes, seconds in self.links.link_loads(loaded, self.bytes_per_token):
            if nbytes:
                moved = self._moved[direction]
                moved.bytes += nbytes
                moved.seconds += seconds
                moved.ops += 1
        verify = self.cost.prefill_s(loaded.verify)
        self.prefill_s += prefill
        self.decode_s += decode
        self.load_s += load
        self.verify_s += verify
        self.now += prefill + decode + load  # verification apart: see ``verify_s``
        self.step_end.append(self.now)
        return self.now

    def link_stats(self) -> dict[str, DirectionStats]:
        """Modeled bytes, seconds and ops so far per link (``TransferStats.snapshot``'s form)."""
        return {d.value: DirectionStats(m.bytes, m.seconds, m.ops) for d, m in self._moved.items()}
