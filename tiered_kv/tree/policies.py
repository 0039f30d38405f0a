"""Eviction policies for one tier of the prefix tree: LRU (default), LFU, FIFO and S3-FIFO.

The tree hands a policy the nodes it may evict; the policy orders them by ``priority`` (lowest
goes first). ``second_chance`` lets a policy keep a node it just picked (S3-FIFO moves a node
that was hit again from its small queue to the main queue, or spends one of its main-queue
credits) by returning True after changing the node's priority; the tree then re-queues it.
Each tier has its own policy object and its own per-node state, so the device and host tiers
can run different policies on the same tree. All clocks are logical (a counter the tree
advances on every access), so runs are deterministic.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any

from tiered_kv.names import EvictionPolicyName, parse

POLICIES = EvictionPolicyName.values()


class EvictionPolicy(ABC):
    name: EvictionPolicyName

    def __init__(self) -> None:
        self._clock = 0
        # Per-node state, keyed by the node object's identity: the same node carries a separate
        # record for each tier's policy.
        self._state: dict[int, list[Any]] = {}

    def tick(self) -> int:
        self._clock += 1
        return self._clock

    def on_insert(self, node: Any) -> None:
        """``node`` entered this tier."""
        t = self.tick()
        self._state[id(node)] = [t, t, 0]  # inserted, last access, hits

    def on_hit(self, node: Any) -> None:
        st = self._state.get(id(node))
        if st is not None:
            st[1] = self.tick()
            st[2] += 1

    def on_remove(self, node: Any) -> None:
        """``node`` left this tier."""
        self._state.pop(id(node), None)

    def on_split(self, old: Any, new_parent: Any) -> None:
        """``new_parent`` was cut from the front of ``old``: it inherits ``old``'s record."""
        st = self._state.get(id(old))
        if st is not None:
            self._state[id(new_parent)] = list(st)

    def __contains__(self, node: Any) -> bool:
        return id(node) in self._state

    @abstractmethod
    def priority(self, node: Any) -> tuple:
        """Lower is evicted first."""

    def second_chance(self, node: Any) -> bool:
        return False


class LRUPolicy(EvictionPolicy):
    name = EvictionPolicyName.LRU

    def priority(self, node: Any) -> tuple:
        return (self._state[id(node)][1],)


class LFUPolicy(EvictionPolicy):
    """Fewest hits first; ties broken by least recent access."""

    name = EvictionPolicyName.LFU

    def priority(self, node: Any) -> tuple:
        st = self._state[id(node)]
        return (st[2], st[1])


class FIFOPolicy(EvictionPolicy):
    name = EvictionPolicyName.FIFO

    def priority(self, node: Any) -> tuple:
        return (self._state[id(node)][0],)


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO: new nodes enter a small FIFO queue; one evicted from there without a second
    hit is remembered in a ghost list; a node hit again while in the small queue moves to the
    main FIFO queue, and so does a re-inserted node found in the ghost list. The main queue
    gives each node up to 3 second chances (one per hit). The small queue is evicted first
    while it holds at least ``small_fraction`` of the tier's nodes, the main queue otherwise.
    Nodes are recognised in the ghost list by ``node.ghost_key`` (their token prefix)."""

    name = EvictionPolicyName.S3FIFO

    def __init__(self, small_fraction: float = 0.1, ghost_limit: int = 1 << 16) -> None:
        super().__init__()
        self.small_fraction = small_fraction
        self.ghost_limit = ghost_limit
        self._ghost: OrderedDict[Any, None] = OrderedDict()
        self._small = 0

    def on_insert(self, node: Any) -> None:
        key = getattr(node, "ghost_key", None)
        in_ghost = key is not None and self._ghost.pop(key, 0) is None
        # state: [queue order, queue ("S" or "M"), frequency 0..3]
        self._state[id(node)] = [self.tick(), "M" if in_ghost else "S", 0]
        if not in_ghost:
            self._small += 1

    def on_hit(self, node: Any) -> None:
        st = self._state.get(id(node))
        if st is not None:
            st[2] = min(3, st[2] + 1)

    def on_remove(self, node: Any) -> None:
        st = self._state.pop(id(node), None)
        if st is None:
            return
        if st[1] == "S":
            self._small -= 1
            key = getattr(node, "ghost_key", None)
            if key is not None and st[2] == 0:
                self._ghost[key] = None
                while len(self._ghost) > self.ghost_limit:
                    self._ghost.popitem(last=False)

    def on_split(self, old: Any, new_parent: Any) -> None:
        st = self._state.get(id(old))
        if st is not None:
            self._state[id(new_parent)] = list(st)
            if st[1] == "S":
                self._small += 1

    def _small_first(self) -> bool:
        return self._small >= self.small_fraction * max(1, len(self._state))

    def priority(self, node: Any) -> tuple:
        order, q, _freq = self._state[id(node)]
        first = "S" if self._small_first() else "M"
        return (0 if q == first else 1, order)

    def second_chance(self, node: Any) -> bool:
        st = self._state[id(node)]
        if st[2] == 0:
            return False
        if st[1] == "S":
            st[1], st[2] = "M", 0
            self._small -= 1
        else:
            st[2] -= 1
        st[0] = self.tick()
        return True


def make_policy(name: str | EvictionPolicyName) -> EvictionPolicy:
    """A fresh policy object (its own per-node state) for one tier."""
    member = parse(EvictionPolicyName, name, "eviction policy")
    classes = {c.name: c for c in (LRUPolicy, LFUPolicy, FIFOPolicy, S3FIFOPolicy)}
    return classes[member]()
