"""vLLM's KV cache groups as the connector sees them: what a hit of E tokens needs from each
group, and the longest hit every group can restore exactly. Bookkeeping only, vLLM-free.

vLLM's hybrid KV cache manager keeps one block table per group; a hit of E tokens (E a multiple
of every group's block size) after ``local`` tokens it computed or cached itself allocates, per
group, exactly these blocks (the rest of the table is the null block 0):

- **full** attention (``FullAttentionSpec``, ``MLAAttentionSpec``): every block
  ``[local/bs, E/bs)``; a hit is a prefix.
- **window** (``SlidingWindowSpec``, window W): only the blocks a query at E can still read,
  ``[max(local/bs, skipped(E)/bs), E/bs)`` with ``skipped(E) = max(0, E - W + 1 - retained)``;
  pages that fell out of the window are neither loaded nor required.
- **state** (``MambaSpec`` in ``align`` mode): one block, ``E/bs - 1``, holding the recurrent
  state after token E-1; a hit can only end where such a state was saved.

``hit_end`` answers the longest E (a multiple of the groups' common step, ``local < E <=
limit``) for which every needed page of every group is present; anything less is a miss and
vLLM computes it. A prefix whose window pages or state are missing is never a hit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import Name


class GroupKind(Name):
    FULL = "full"
    WINDOW = "window"
    STATE = "state"


@dataclass(frozen=True)
class GroupPlan:
    """One KV cache group: its index in vLLM's ``kv_cache_groups``, kind and block size;
    ``window`` / ``retained`` (tokens vLLM keeps beyond the window) for a window group."""

    index: int
    kind: GroupKind
    block_size: int
    window: int = 0
    retained: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise InvalidArgumentError(f"group {self.index}: block_size={self.block_size} <= 0")
        if self.kind is GroupKind.WINDOW and self.window <= 0:
            raise InvalidArgumentError(f"group {self.index}: a window group needs window > 0")

    def skipped(self, n: int) -> int:
        """Tokens at the start whose KV a request of ``n`` computed tokens no longer reads."""
        if self.kind is GroupKind.WINDOW:
            return max(0, n - self.window + 1 - self.retained)
        if self.kind is GroupKind.STATE:
            return max(0, n - 1)
        return 0

    def needed(self, local: int, end: int) -> range:
        """Block indices vLLM allocates (non-null) for a hit ending at ``end`` after ``local``
        tokens it holds itself: those the connector fills, and must hold, for that hit."""
        bs = self.block_size
        if end <= local:
            return range(0)
        if self.kind is GroupKind.STATE:
            return range(end // bs - 1, end // bs)
        return range(max(local // bs, self.skipped(end) // bs), end // bs)


@dataclass(frozen=True)
class GroupGrid:
    """Every group of an engine: ``unit`` is the token grid page digests are chained at (the
    gcd of the block sizes: vLLM's ``hash_block_size``), ``step`` the grid a hit ends on (their
    lcm: vLLM's scheduler block size)."""

    groups: tuple[GroupPlan, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise InvalidArgumentError("an engine has at least one KV cache group")
        if [g.index for g in self.groups] != list(range(len(self.groups))):
            raise InvalidArgumentError("groups must be listed in vLLM's order, 0..n-1")

    @property
    def unit(self) -> int:
        return math.gcd(*(g.block_size for g in self.groups))

    @property
    def step(self) -> int:
        return math.lcm(*(g.block_size for g in self.groups))

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1 or self.groups[0].kind is not GroupKind.FULL

    def digest_index(self, group: GroupPlan, block: int) -> int:
        """Which page digest (chained every ``unit`` tokens) names ``block`` of ``group``: the
        one at the block's last unit."""
        return (block + 1) * (group.block_size // self.unit) - 1

    def hit_end(
        self,
        local: int,
        limit: int,
        present: Callable[[GroupPlan, Sequence[int]], list[bool]],
    ) -> int:
        """The longest hit end E (a multiple of ``step``, ``local < E <= limit``) for which
        ``present(group, blocks)`` holds every block ``group.needed(local, E)`` names; ``local``
        when there is none. ``present`` is asked once per group, over the blocks any candidate
        could need."""
        step = self.step
        top = limit // step * step
        if top <= local:
            return local
        for g in self.groups:  # full groups: the hit is a prefix of what they hold
            if g.kind is not GroupKind.FULL:
                continue
            blocks = g.needed(local, top)
            have = present(g, list(blocks)) if blocks else []
            lead = next((i for i, ok in enumerate(have) if not ok), len(have))
            top = min(top, (blocks.start + lead) * g.block_size // step * step)
            if top <= local:
                return local
        known: dict[int, dict[int, bool]] = {}
        for g in self.groups:
            if g.kind is GroupKind.FULL:
                continue
            first = g.needed(local, local + step).start if g.kind is GroupKind.WINDOW else 0
            span = range(max(first, local // g.block_size), top // g.block_size)
            known[g.index] = dict(zip(span, present(g, list(span)) if span else [], strict=True))
        for end in range(top, local, -step):
            if all(
                all(known[g.index].get(b, False) for b in g.needed(local, end))
                for g in self.groups
                if g.kind is not GroupKind.FULL
            ):
                return end
        return local
