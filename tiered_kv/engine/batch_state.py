"""The scheduler's plain data: its frozen config, one engine request's progress, what a step
did, and the counters that prove admission never over-commits. No tensors are moved here."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from tiered_kv._checks import check_positive_int
from tiered_kv.cache import Request
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import Name, parse


class SchedulePolicy(Name):
    """The order the waiting queue is admitted in."""

    FCFS = "fcfs"  # by arrival
    CACHE_AWARE = "cache_aware"  # longest cached prefix first (device, then host tokens)


class ReqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SchedulerConfig:
    """``chunk_size``: the most prompt tokens of one request computed in one step (a multiple
    of the cache's page size, checked by the scheduler). ``max_prefill_tokens``: the prefill
    budget of a step over all requests (None: ``chunk_size``). ``max_wait_steps``: a request
    queued this many steps goes before every younger one, whatever the policy.
    ``decode_reserve_tokens``: room kept per running request for its decode at admission (None:
    the allocator's ``request_slot_reserve()``). ``host_weight``: what a host-cached token is
    worth against a device-cached one in the cache-aware order (a host hit costs a load);
    ``storage_weight``: the same for a page storage holds (a disk read and a load; 0: storage
    is not asked).
    ``defer_shared_tokens``: cache-aware only: a waiting request whose prompt shares at least
    this many more tokens with a running request's than it has cached waits for that one to
    finish and cache them instead of computing them twice (None: ``chunk_size``; 0: never; the
    starvation bound overrides it). ``record_logits``: keep the logits that chose every output
    token (for verification). ``debug``: a stall (a step with nothing running and nothing
    admitted though no copy was in flight: a bug, see ``engine.liveness``) raises
    ``LivenessError`` at once instead of being counted in ``SchedulerStats.stalls``."""

    chunk_size: int = 64
    max_prefill_tokens: int | None = None
    max_running: int = 8
    policy: SchedulePolicy = SchedulePolicy.FCFS
    max_wait_steps: int = 64
    decode_reserve_tokens: int | None = None
    host_weight: float = 0.5
    storage_weight: float = 0.25
    defer_shared_tokens: int | None = None
    record_logits: bool = False
    debug: bool = False

    def __post_init__(self) -> None:
        check_positive_int("chunk_size", self.chunk_size)
        check_positive_int("max_running", self.max_running)
        check_positive_int("max_wait_steps", self.max_wait_steps)
        if self.max_prefill_tokens is not None:
            check_positive_int("max_prefill_tokens", self.max_prefill_tokens)
        if self.defer_shared_tokens is not None:
            check_positive_int("defer_shared_tokens", self.defer_shared_tokens, minimum=0)
        if self.decode_reserve_tokens is not None:
            check_positive_int("decode_reserve_tokens", self.decode_reserve_tokens, minimum=0)
        object.__setattr__(self, "policy", parse(SchedulePolicy, self.policy, "policy"))
        for name in ("host_weight", "storage_weight"):
            w = getattr(self, name)
            number = isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
            if not number or not 0 <= w <= 1:
                raise InvalidArgumentError(f"{name}={w!r} is invalid; expected a number 0..1")
        for name in ("record_logits", "debug"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(f"{name}={getattr(self, name)!r} must be a bool")

    def check_against(self, page_size: int, max_requests: int) -> None:
        """The fields that depend on the cache: whole-page chunks, a row per running request."""
        if self.chunk_size % page_size:
            raise InvalidArgumentError(
                f"chunk_size={self.chunk_size} must be a multiple of the page size {page_size} "
                f"(try {max(page_size, self.chunk_size // page_size * page_size)})"
            )
        if self.max_running > max_requests:
            raise InvalidArgumentError(
                f"max_running={self.max_running} exceeds the cache's max_requests={max_requests}"
            )

    @property
    def prefill_budget(self) -> int:
        return self.max_prefill_tokens if self.max_prefill_tokens is not None else self.chunk_size

    @property
    def defer_threshold(self) -> int:
        """Shared tokens that make a cache-aware request wait (0: never)."""
        if self.policy is not SchedulePolicy.CACHE_AWARE:
            return 0
        d = self.defer_shared_tokens
        return self.chunk_size if d is None else d


@dataclass
class EngineRequest:
    """One generation request as the scheduler sees it. ``output`` holds every token chosen so
    far; the KV a running request holds covers ``prompt + output[:-1]`` once its prefill is
    done (the newest token is fed by the next decode step). A retracted request is admitted
    again with ``prompt + output`` as the prompt to compute (its cached prefix served)."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int
    extra_key: str | bytes | None = None  # its identity beyond its tokens (``begin``)
    prior: bytes = b""  # that identity's chain prior (``storage.keys.extra_key_prior``)
    output: list[int] = field(default_factory=list)
    state: ReqState = ReqState.WAITING
    queued_step: int = 0  # when it last entered the waiting queue (the starvation clock)
    admit_step: int | None = None  # first admission
    first_token_step: int | None = None
    finish_step: int | None = None
    cached_tokens: int = 0  # prefix served from the cache at its first admission
    retractions: int = 0
    resumed_cached: list[int] = field(default_factory=list)  # prefix served at each resumption
    logits: list[torch.Tensor] = field(default_factory=list)  # with record_logits
    # While running: the cache's request, the tokens to prefill (prompt + output at admission).
    cache_req: Request | None = None
    target: list[int] = field(default_factory=list)
    admit_seq: int = 0

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens

    def note_admitted(self, step: int, tokens: int, prefix_len: int, stats: SchedulerStats) -> None:
        """Count an admission of ``tokens`` tokens, ``prefix_len`` of them served from the cache:
        the first one's prompt and hits, a resumption's hit apart."""
        if self.admit_step is None:
            self.admit_step, self.cached_tokens = step, prefix_len
            stats.prompt_tokens += tokens
            stats.cached_tokens += prefix_len
        else:
            self.resumed_cached.append(prefix_len)
        stats.admitted += 1

    @property
    def prefilling(self) -> bool:
        return self.cache_req is not None and len(self.cache_req.tokens) < len(self.target)

    @property
    def ttft_steps(self) -> int | None:
        if self.first_token_step is None:
            return None
        return self.first_token_step - self.arrival_step


class StepResult(NamedTuple):
    """What one ``Scheduler.step`` did (request ids)."""

    step: int
    admitted: tuple[int, ...]
    prefilled_tokens: int
    decoded: tuple[int, ...]
    finished: tuple[int, ...]
    retracted: tuple[int, ...]


@dataclass
class SchedulerStats:
    """Counted events. ``overcommits``: an allocation the budget said fits was refused (or a
    begun request no longer fit): admission over-committed; always 0 when it is right."""

    steps: int = 0
    admitted: int = 0
    retracted: int = 0
    finished: int = 0
    overcommits: int = 0
    load_failures: int = 0  # a prefix load failed: the request went back to the queue
    # begun with the step's batch but no longer fitting with the prefix its begin locked (a
    # failed load, or a device prefix another's load evicted): back to the queue, unbegun
    admission_recheck_failed: int = 0
    # nothing ran and the queue's head did not fit while copies in flight held pages: the
    # step waited for them instead of spinning
    idle_waits: int = 0
    # nothing ran, nothing was admitted and no copy was in flight: a liveness bug, counted
    # (``SchedulerConfig.debug`` raises instead)
    stalls: int = 0
    # the head of the queue admitted alone with no prefix: neither its cached prefix with its
    # host part nor its device part alone fitted beside what that prefix locks (its
    # prefix is computed instead)
    uncached_admissions: int = 0
    draft_trees: int = 0  # speculative decoding: draft trees allocated
    draft_pages: int = 0  # and their pages
    prompt_tokens: int = 0  # over first admissions
    cached_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def admission_order(
    waiting: list[EngineRequest],
    step: int,
    config: SchedulerConfig,
    cached: Callable[[EngineRequest], tuple[int, int, int, int]],
) -> list[EngineRequest]:
    """The order ``waiting`` is tried for admission at ``step``: every request queued for
    ``max_wait_steps`` or more first (oldest first, whatever the policy: the starvation
    bound), then the others by arrival (FCFS) or by ``cached(request)``'s (device, host,
    storage, ...) cached prefix tokens, a host token worth ``host_weight`` of a device one and
    a stored one ``storage_weight`` (cache-aware)."""
    bound = config.max_wait_steps
    starving = sorted(
        (w for w in waiting if step - w.queued_step >= bound), key=lambda w: (w.queued_step, w.rid)
    )
    rest = [w for w in waiting if step - w.queued_step < bound]
    if config.policy is SchedulePolicy.CACHE_AWARE:
        scores = {}
        for w in rest:
            device, host, stored, *_ = cached(w)
            scores[w.rid] = device + config.host_weight * host + config.storage_weight * stored
        rest.sort(key=lambda w: (-scores[w.rid], w.queued_step, w.rid))
    else:
        rest.sort(key=lambda w: (w.queued_step, w.rid))
    return starving + rest


def shared_len(a: list[int], b: list[int], page_size: int) -> int:
    """Whole pages of ``a[:-1]`` that ``b`` starts with (what ``a`` could hit once ``b``'s KV
    is cached: the last prompt token is always computed)."""
    n = 0
    for x, y in zip(a[:-1], b, strict=False):
        if x != y:
            break
        n += 1
    return n - n % page_size
