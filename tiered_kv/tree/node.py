"""TreeNode and the page-aligned key helpers of the prefix tree.

A node owns a run of whole pages of tokens (``key``, a tuple of token ids) and records where
that run's KV lives: ``device`` (device slot indices) and ``host`` (host slot indices), each a
tensor as long as the key or ``None``, and ``in_storage``. ``digests`` holds the storage chain
digest of each page (continuing from the parent's last page). Children are keyed by their first
page. ``lock_ref`` (device) and ``host_ref`` (host) count users of the node and its ancestors.
``pending`` maps each kind of copy in flight that touches the node to its job id.
``windowless`` (sliding-window models) marks a tombstone: the node's window-layer KV was freed,
its full KV is kept on every tier that holds the node.

Nodes are plain records: only :class:`TieredTree` changes their fields, so the tree's residency
counters stay exact.
"""

from __future__ import annotations

import itertools

import torch

from tiered_kv.names import JobId, PageDigest, PendingKind

_IDS = itertools.count(1)


class TreeNode:
    __slots__ = (
        "id",
        "key",
        "parent",
        "children",
        "device",
        "host",
        "digests",
        "in_storage",
        "lock_ref",
        "host_ref",
        "pending",
        "hit_count",
        "stale",
        "windowless",
        "__weakref__",
    )

    def __init__(self, key: tuple = (), parent: TreeNode | None = None) -> None:
        self.id = next(_IDS)
        self.key = key
        self.parent = parent
        self.children: dict[tuple, TreeNode] = {}
        self.device: torch.Tensor | None = None
        self.host: torch.Tensor | None = None
        self.digests: list[PageDigest] = []
        self.in_storage = False
        self.lock_ref = 0
        self.host_ref = 0
        self.pending: dict[PendingKind, JobId] = {}
        self.hit_count = 0
        # Device copy is garbage (a failed load's, or quarantined): dropped once nothing holds it.
        self.stale = False
        # Sliding-window models: the node's window KV is held nowhere (tombstone), only its
        # full KV; such a node is hit only where no query of a hit needs its window KV.
        self.windowless = False

    def __len__(self) -> int:
        return len(self.key)

    @property
    def ghost_key(self) -> tuple:
        """Identity of the node's token prefix (for S3-FIFO's ghost list)."""
        return (self.parent.id if self.parent is not None else 0, self.key[:64], len(self.key))

    @property
    def on_device(self) -> bool:
        return self.device is not None

    @property
    def on_host(self) -> bool:
        return self.host is not None

    @property
    def attached(self) -> bool:
        return self.parent is not None

    def last_digest(self) -> bytes:
        return self.digests[-1] if self.digests else b""

    def __repr__(self) -> str:
        where = "".join(
            c
            for c, on in (("D", self.on_device), ("H", self.on_host), ("S", self.in_storage))
            if on
        )
        return (
            f"TreeNode(id={self.id}, tokens={len(self.key)}, {where or '-'}, lock={self.lock_ref})"
        )


def first_page(key: tuple, page_size: int) -> tuple:
    return key[:page_size]


def page_key(tokens, page_size: int) -> tuple:
    """The whole pages of ``tokens`` as a tuple of Python ints (the tree's key)."""
    head = tokens[: len(tokens) - len(tokens) % page_size]
    if type(head) is list and set(map(type, head)) <= {int}:
        return tuple(head)  # the common case, without converting every token (~5x faster)
    tolist = getattr(head, "tolist", None)  # a tensor or an array: Python ints at once
    return tuple(tolist() if tolist is not None else (int(t) for t in head))


def common_pages(a: tuple, b: tuple, page_size: int) -> int:
    """Tokens in the longest common prefix of ``a`` and ``b`` made of whole pages."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i - i % page_size


def path_to_root(node: TreeNode):
    """``node`` and its ancestors, excluding the root."""
    while node.parent is not None:
        yield node
        node = node.parent


def walk(root: TreeNode):
    """Every node below ``root`` (depth first, parents before children)."""
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())
