"""LoadPlanner: per request, how much of a cached prefix to load from each tier and how much
to compute again, from moving estimates of each link's cost against the engine's compute cost.

Bookkeeping only: no tensors, no jobs. ``lifecycle.begin`` asks ``plan(match)`` before any
storage prefetch or host load starts, so a storage hit slower to load than to recompute is never
fetched. The modeled time of taking the first ``cut`` matched tokens (a whole number of pages
from the device part's end to the match's end; the device part costs nothing and is always
taken) is

    load(cut)    = h2d(bytes of the host and storage tokens taken)   (one op: one load-back)
                 + s2h(bytes of the storage tokens taken)            (one op: one prefetch)
    compute(cut) = compute_cost(match_end - cut, cut)                (the declined tokens,
                                                                      computed after ``cut``)

with each link ``op_s + bytes / bytes_per_s`` (a storage hit crosses both links). The tokens
after the match are computed whatever the cut, so they are left out. Every page cut is tried
(attention makes later tokens dearer to compute, so the best cut need not be a tier boundary);
the cheapest wins, a tie going to the longer cut. Loads and compute are added, not overlapped:
the conservative case (a layer-wise load overlaps the forward only in part).

Each link's estimate (:class:`LinkEstimate`) is a least-squares line of seconds against bytes
per copy op over exponentially weighted observations: EWMAs of the line's sums, so it follows a
link that slows down. Before any observation the stated priors (``TieredKVConfig``'s
``planner_*`` fields) are the estimate; they count as ``PRIOR_WEIGHT`` old ops and fade as
observations come. Observations come from a load source: cumulative per-direction
``DirectionStats`` (by default the cache's own transfer stats, i.e. copies measured on this
machine; ``tiered-kv run`` feeds its modeled link times instead), read as deltas at each plan.
Until the storage link has been observed at all, a storage part is taken at most
``probe_tokens`` long: a probe, so a prior that is wrong about the disk costs one small load.
A tier whose hits are all declined is no longer observed: its estimate stays where it was.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tiered_kv.cache.prefix_match import PrefixMatch
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import Direction
from tiered_kv.transfer.stats import DirectionStats

ComputeCost = Callable[[int, int], float]  # (tokens computed, tokens before them) -> seconds
LoadSource = Callable[[], Mapping[str, DirectionStats]]  # cumulative stats per direction
LINKS = (Direction.HOST_TO_DEVICE, Direction.STORAGE_TO_HOST)
ALPHA = 0.1  # each new op weighs 1; earlier ones decay by 1 - ALPHA per op
PRIOR_WEIGHT = 2.0  # the prior counts as this many old ops
_DISTINCT = 1e-6  # op sizes whose variance is under this share of their squared mean: one size
_MIN_SLOPE = 1e-18  # seconds per byte: a link never looks infinitely fast


def _number(name: str, value: object, *, zero_ok: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise InvalidArgumentError(f"{name}={value!r} is invalid: a finite number {bound}")
    return float(value)


class LinkEstimate:
    """``seconds(nbytes) = op_s + nbytes / bytes_per_s``, fitted to observed copy ops.

    The estimate is the prior's line and the observations' line weighted by what each still
    weighs: the prior ``prior_weight`` ops, the observations one per op, both decaying by
    ``1 - alpha`` per new op (so the prior fades and a link that changes is followed). The
    observations' line is the weighted least-squares fit of seconds against bytes per op; while
    the ops seen do not tell a fixed cost from a per-byte one (all of one size, or a fit with a
    negative part) every second is charged to bandwidth, so a bigger load never looks free."""

    def __init__(
        self,
        bytes_per_s: float,
        op_s: float,
        *,
        alpha: float = ALPHA,
        prior_weight: float = PRIOR_WEIGHT,
    ) -> None:
        self.prior_slope = 1.0 / _number("bytes_per_s", bytes_per_s)
        self.prior_op_s = _number("op_s", op_s, zero_ok=True)
        self.alpha = _number("alpha", alpha)
        if self.alpha >= 1:
            raise InvalidArgumentError(f"alpha={alpha!r} is invalid: a number in (0, 1)")
        self._prior = _number("prior_weight", prior_weight)
        self._sums = [0.0] * 5  # weights, x, x^2, y, x*y (x: bytes per op, y: seconds per op)
        self.observed_ops = 0
        self._fit = (self.prior_op_s, self.prior_slope)

    def observe(self, nbytes: float, seconds: float, ops: int = 1) -> None:
        """``ops`` copy ops that moved ``nbytes`` (> 0) in ``seconds`` in all (each counted
        as one op of the mean size and time)."""
        if isinstance(ops, bool) or not isinstance(ops, int) or ops < 1:
            raise InvalidArgumentError(f"ops={ops!r} is invalid: an int >= 1")
        x = _number("nbytes", nbytes) / ops
        y = _number("seconds", seconds, zero_ok=True) / ops
        keep = (1.0 - self.alpha) ** ops
        s = [v * keep for v in self._sums]
        for i, v in enumerate((1.0, x, x * x, y, x * y)):
            s[i] += ops * v
        self._sums, self._prior = s, self._prior * keep
        self.observed_ops += ops
        a, b = self._data_line()
        share = s[0] / (s[0] + self._prior)
        self._fit = (
            share * a + (1 - share) * self.prior_op_s,
            max(_MIN_SLOPE, share * b + (1 - share) * self.prior_slope),
        )

    def _data_line(self) -> tuple[float, float]:
        """(fixed seconds, seconds per byte) of the observations alone."""
        w, sx, sxx, sy, sxy = self._sums
        spread = sxx * w - sx * sx  # w^2 times the variance of the op sizes
        if spread > _DISTINCT * sx * sx:
            b = (w * sxy - sx * sy) / spread
            a = (sy - b * sx) / w
            if a >= 0 and b > 0:
                return a, b
        return 0.0, sxy / sxx  # through the origin: every second charged to bandwidth

    @property
    def op_s(self) -> float:
        return self._fit[0]

    @property
    def bytes_per_s(self) -> float:
        return 1.0 / self._fit[1]

    def seconds(self, nbytes: float) -> float:
        """Estimated seconds of one op moving ``nbytes`` (0 for nothing)."""
        return self._fit[0] + nbytes * self._fit[1] if nbytes > 0 else 0.0


@dataclass(frozen=True)
class PlannerPriors:
    """The estimates before any observation (``TieredKVConfig.planner_*``)."""

    host_bytes_per_s: float = 25e9  # host -> device
    storage_bytes_per_s: float = 6e9  # storage -> host
    host_op_s: float = 1e-5
    storage_op_s: float = 1e-4
    prefill_tokens_per_s: float = 30_000.0  # until the engine says (``set_compute_cost``)


def best_cut(
    device: int,
    host: int,
    storage: int,
    page_size: int,
    load_s: Callable[[int, int], float],
    compute_s: ComputeCost,
) -> int:
    """The number of matched tokens to take: every page cut from ``device`` to
    ``device + host + storage`` is priced ``load_s(host tokens taken, storage tokens taken) +
    compute_s(tokens declined, cut)``; the cheapest wins, a tie going to the longer cut."""
    end = device + host + storage
    best, best_s = end, math.inf
    for cut in range(end, device - 1, -page_size):  # longest first: a tie keeps it
        took_host = min(cut, device + host) - device
        took_storage = max(0, cut - device - host)
        t = load_s(took_host, took_storage) + (compute_s(end - cut, cut) if cut < end else 0.0)
        if t < best_s:
            best, best_s = cut, t
    return best


class LoadPlanner:
    """Chooses per request how much of its cached prefix to load (``plan``), from link
    estimates fed by a load source and an engine-supplied compute cost.

    ``probe_tokens`` (whole pages; None: one page): until the storage link has been observed,
    a storage part is taken at most this long, so a prior that is wrong about the disk costs
    one small load, not one the size of the hit (the first observation then corrects it)."""

    def __init__(
        self,
        page_size: int,
        bytes_per_token: int,
        priors: PlannerPriors,
        load_source: LoadSource | None = None,
        probe_tokens: int | None = None,
    ) -> None:
        probe = page_size if probe_tokens is None else probe_tokens
        for name, v in (("page_size", page_size), ("bytes_per_token", bytes_per_token),
                        ("probe_tokens", probe)):  # fmt: skip
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"{name}={v!r} is invalid: an int >= 1")
        if probe % page_size:
            raise InvalidArgumentError(
                f"probe_tokens={probe} is invalid: a whole number of pages of {page_size}"
            )
        if not isinstance(priors, PlannerPriors):
            raise InvalidArgumentError(f"priors must be PlannerPriors, got {type(priors).__name__}")
        self.page_size, self.bytes_per_token, self.priors = page_size, bytes_per_token, priors
        self.probe_tokens = probe
        self.links = {
            Direction.HOST_TO_DEVICE: LinkEstimate(priors.host_bytes_per_s, priors.host_op_s),
            Direction.STORAGE_TO_HOST: LinkEstimate(
                priors.storage_bytes_per_s, priors.storage_op_s
            ),
        }
        rate = _number("prefill_tokens_per_s", priors.prefill_tokens_per_s)
        self._compute: ComputeCost = lambda tokens, context: tokens / rate
        self.compute_source = "prior"  # or "engine" once set_compute_cost was called
        self._source: LoadSource | None = None
        self._seen: dict[str, DirectionStats] = {}
        if load_source is not None:
            self.set_load_source(load_source)

    def set_compute_cost(self, fn: ComputeCost) -> None:
        """The engine's prefill cost: ``fn(tokens, context)`` -> seconds to compute ``tokens``
        new tokens after ``context`` cached ones (replaces ``prefill_tokens_per_s``)."""
        if not callable(fn):
            raise InvalidArgumentError(
                f"compute cost must be callable (tokens, context) -> seconds, got {fn!r:.60}"
            )
        self._compute, self.compute_source = fn, "engine"

    def set_load_source(self, fn: LoadSource) -> None:
        """Where observations come from: ``fn()`` -> cumulative ``DirectionStats`` per
        direction (``TransferStats.snapshot``'s form). What it holds now is the baseline."""
        if not callable(fn):
            raise InvalidArgumentError(
                f"load source must be callable () -> {{direction: DirectionStats}}, got {fn!r:.60}"
            )
        self._source, self._seen = fn, dict(fn())

    def refresh(self) -> None:
        """Observe what the load source moved since the last look (ops that failed left out)."""
        if self._source is None:
            return
        now = dict(self._source())
        for d, est in self.links.items():
            new, old = now.get(d), self._seen.get(d, DirectionStats())
            if new is None:
                continue
            ops = (new.ops - new.failed_ops) - (old.ops - old.failed_ops)
            nbytes, seconds = new.bytes - old.bytes, new.seconds - old.seconds
            if ops > 0 and nbytes > 0 and seconds >= 0:
                est.observe(nbytes, seconds, ops)
        self._seen = now

    def load_s(self, host_tokens: int, storage_tokens: int) -> float:
        """Estimated seconds to bring ``host_tokens`` from host and ``storage_tokens`` from
        storage to the device (the storage ones cross both links)."""
        bpt, links = self.bytes_per_token, self.links
        t = links[Direction.HOST_TO_DEVICE].seconds((host_tokens + storage_tokens) * bpt)
        return t + links[Direction.STORAGE_TO_HOST].seconds(storage_tokens * bpt)

    def compute_s(self, tokens: int, context: int) -> float:
        t = self._compute(tokens, context)
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not t >= 0:
            raise InvalidArgumentError(
                f"compute cost({tokens}, {context}) returned {t!r}; it must be seconds >= 0"
            )
        return float(t)

    def plan(self, match: PrefixMatch) -> int:
        """Matched tokens of ``match`` to take (a whole number of pages, at least its device
        part); the rest of the match is computed. Observes the load source first."""
        self.refresh()
        before_storage = match.device_hit_length + match.host_hit_length
        cut = best_cut(
            match.device_hit_length, match.host_hit_length, match.storage_hit_length,
            self.page_size, self.load_s, self.compute_s,
        )  # fmt: skip
        if not self.links[Direction.STORAGE_TO_HOST].observed_ops:  # the disk is a guess yet
            cut = min(cut, before_storage + self.probe_tokens)
        return cut

    def estimates(self) -> dict:
        """What the planner believes now (for reports): per link GB/s, fixed seconds per op
        and ops observed; where the compute cost comes from."""
        out: dict = {
            d.value: {"gbps": e.bytes_per_s / 1e9, "op_s": e.op_s, "observed_ops": e.observed_ops}
            for d, e in self.links.items()
        }
        out["compute"] = self.compute_source
        return out
