"""Eviction policies for one tier of the prefix tree: LRU (default), LFU, FIFO, S3-FIFO and
ghost-LRU (LRU with admission on the second sighting).

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

from tiered_kv.errors import InvalidArgumentError
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

    # The victim queue keeps one heap per bucket: ``priority`` is (the bucket's rank now,
    # *``order``), ``order`` only grows while a node stays in its bucket, and a node changes
    # bucket only on an insert, a hit, a split or a second chance.
    def bucket(self, node: Any) -> Any:
        return 0

    def bucket_rank(self, bucket: Any, head: Any = None) -> Any:
        return 0

    def order(self, node: Any) -> tuple:
        return self.priority(node)

    def take_changed(self) -> list:
        """Nodes whose bucket this policy changed while handling another node's event (since
        the last call); the victim queue re-examines them."""
        return []

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

    def bucket(self, node: Any) -> Any:
        return self._state[id(node)][1]

    def bucket_rank(self, bucket: Any, head: Any = None) -> Any:
        return 0 if bucket == ("S" if self._small_first() else "M") else 1

    def order(self, node: Any) -> tuple:
        return (self._state[id(node)][0],)

    def priority(self, node: Any) -> tuple:
        order, q, _freq = self._state[id(node)]
        return (self.bucket_rank(q), order)

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


def admission_key(node: Any) -> Any:
    """A node's identity for a ghost list, stable across evictions of the node: its first page's
    chain digest when the tree keeps digests, else (its parent's id, its first token). A parent
    keeps its id when it is split (the split makes a new front node above it), so children
    re-inserted below it find their ghost entries; a collision only mis-admits a node."""
    digests = getattr(node, "digests", None)
    if digests:
        return digests[0]
    parent = node.parent
    return (parent.id if parent is not None else 0, tuple(node.key[:1]))


class GhostLRUPolicy(EvictionPolicy):
    """LRU with admission on the second sighting. A node enters *probationary* unless its
    :func:`admission_key` is in the ghost list (the keys of recently evicted nodes), in which
    case it enters *protected*; a hit promotes a probationary node. While probationary nodes
    hold more than ``probation_floor`` of the tier's tokens they are evicted first (least
    recently used first), then the protected ones in LRU order. So a one-hit suffix is the
    first victim instead of displacing reused blocks, and a block that comes back after being
    evicted is kept like any reused one.

    Only the order changes: the tree still offers only evictable nodes (a leaf on the device,
    unlocked, no copy in flight), so a protected child keeps its probationary parent until the
    child goes, and no child outlives its parent on a tier. ``ghost_limit`` bounds the ghost
    list (entries, oldest forgotten first)."""

    name = EvictionPolicyName.GHOST_LRU

    def __init__(self, probation_floor: float = 0.0, ghost_limit: int = 1 << 17) -> None:
        super().__init__()
        if not 0.0 <= probation_floor < 1.0:
            raise InvalidArgumentError(
                f"probation_floor={probation_floor!r} must be in [0, 1): the share of the "
                "tier's tokens probationary nodes keep before they stop going first"
            )
        if ghost_limit < 0:
            raise InvalidArgumentError(f"ghost_limit={ghost_limit!r} must be >= 0")
        self.probation_floor = probation_floor
        self.ghost_limit = ghost_limit
        self._ghost: OrderedDict[Any, None] = OrderedDict()
        self.tokens = 0  # tokens of the nodes this tier holds
        self.probation_tokens = 0  # of which in probationary nodes

    def on_insert(self, node: Any) -> None:
        returning = self._ghost.pop(admission_key(node), 0) is None
        t = self.tick()
        # state: [inserted, last access, hits, protected, tokens]
        self._state[id(node)] = [t, t, 0, returning, len(node)]
        self.tokens += len(node)
        if not returning:
            self.probation_tokens += len(node)

    def on_hit(self, node: Any) -> None:
        st = self._state.get(id(node))
        if st is None:
            return
        st[1] = self.tick()
        st[2] += 1
        if not st[3]:
            st[3] = True
            self.probation_tokens -= st[4]

    def on_remove(self, node: Any) -> None:
        st = self._state.pop(id(node), None)
        if st is None:
            return
        self.tokens -= st[4]
        if not st[3]:
            self.probation_tokens -= st[4]
        if self.ghost_limit and node.parent is not None:
            key = admission_key(node)
            self._ghost[key] = None
            self._ghost.move_to_end(key)
            while len(self._ghost) > self.ghost_limit:
                self._ghost.popitem(last=False)

    def on_split(self, old: Any, new_parent: Any) -> None:
        # Called after the cut: ``old`` is the back part; the two parts' tokens add up to the
        # record's, so the tier's totals stay as they were.
        st = self._state.get(id(old))
        if st is not None:
            self._state[id(new_parent)] = [*st[:4], len(new_parent)]
            st[4] = len(old)

    def in_ghost(self, node: Any) -> bool:
        return admission_key(node) in self._ghost

    def is_protected(self, node: Any) -> bool:
        return bool(self._state[id(node)][3])

    def bucket(self, node: Any) -> Any:
        return bool(self._state[id(node)][3])  # True: protected

    def bucket_rank(self, bucket: Any, head: Any = None) -> Any:
        probation_first = self.probation_tokens > self.probation_floor * self.tokens
        return 0 if (not bucket) == probation_first else 1

    def order(self, node: Any) -> tuple:
        return (self._state[id(node)][1],)

    def priority(self, node: Any) -> tuple:
        st = self._state[id(node)]
        return (self.bucket_rank(bool(st[3])), st[1])


def make_policy(name: str | EvictionPolicyName) -> EvictionPolicy:
    """A fresh policy object (its own per-node state) for one tier."""
    member = parse(EvictionPolicyName, name, "eviction policy")
    policies = (LRUPolicy, LFUPolicy, FIFOPolicy, S3FIFOPolicy, GhostLRUPolicy)
    classes = {c.name: c for c in policies}
    return classes[member]()
