"""TieredTree: which pages of a prefix live on which tier, with refs, locks and policy order.

Bookkeeping only: the tree never allocates, frees, copies, waits or touches storage. Methods
that take slots away from a node return them (the manager frees them); :meth:`match` is a pure
read; hits are counted by :meth:`touch`; :meth:`insert` returns the nodes it created.

Residency rules kept at all times (``check_integrity`` verifies them):
- every node is on the device, on the host, or both (a node that loses both leaves the tree);
- device residency is prefix-closed: a node on the device has its parent on the device, so a
  match is "device part, then host part";
- ``lock_ref`` > 0 keeps a node's device slots, ``host_ref`` > 0 its host slots; a node with a
  copy in flight (``pending``) is never evicted from the tier the copy touches.
- each request identity (``extra_key``) matches and inserts below a root of its own
  (``tree.roots``): no page is ever shared across identities.
The residency sizes (device tokens, host tokens, evictable device tokens) are kept as counters,
updated by every method that changes a node, never by walking the tree.
"""

from __future__ import annotations

import torch

from tiered_kv.errors import InvalidArgumentError, StateError
from tiered_kv.names import JobId, PendingKind
from tiered_kv.storage.keys import page_digests
from tiered_kv.tree.node import TreeNode, common_pages, first_page, page_key, path_to_root, walk
from tiered_kv.tree.policies import EvictionPolicy, make_policy
from tiered_kv.tree.results import Released, TreeMatch
from tiered_kv.tree.roots import IdentityRoots
from tiered_kv.tree.victim_queue import VictimQueue

_EMPTY = torch.empty(0, dtype=torch.int64)


class TieredTree:
    def __init__(
        self,
        page_size: int,
        *,
        device_policy: str = "lru",
        host_policy: str = "lru",
        digests: bool = False,
    ) -> None:
        self.page_size = page_size
        self.digests = digests  # keep each page's storage chain digest
        self.device_policy: EvictionPolicy = make_policy(device_policy)
        self.host_policy: EvictionPolicy = make_policy(host_policy)
        self._roots = IdentityRoots()  # one per request identity (``tree.roots``)
        self.root = self._roots.default  # the root of requests without an extra key
        self.device_tokens = 0
        self.host_tokens = 0
        self.evictable_device_tokens = 0  # on the device with lock_ref == 0
        self._jobs: dict[JobId, tuple[PendingKind, list[TreeNode]]] = {}
        # Each tier's evictable nodes in policy order, told of every change that may matter.
        self.device_queue = VictimQueue()
        self.host_queue = VictimQueue()

    def _mark(self, node: TreeNode | None) -> None:
        if node is not None:
            self.device_queue.mark(node)
            self.host_queue.mark(node)

    def nodes(self) -> list[TreeNode]:
        return list(self.walk())

    def walk(self):
        """Every node below every root (depth first, parents before children)."""
        return self._roots.walk()

    @property
    def roots(self) -> dict[bytes, TreeNode]:
        """The root of each request identity in the tree, by chain prior (b"": the default)."""
        return self._roots.by_prior()

    def aligned(self, tokens) -> tuple:
        return page_key(tokens, self.page_size)

    # -- reading --------------------------------------------------------------------------------
    def match(self, tokens, *, probe: bool = True, prior: bytes = b"") -> TreeMatch:
        """The cached prefix of ``tokens`` (whole pages) under the request identity ``prior``
        (``extra_key_prior``; b"": none). Changes nothing. ``probe``: also the chain digests of
        the pages after it (when the tree keeps digests)."""
        key = self.aligned(tokens)
        root = self._roots.get(prior, create=False)
        node, pos, chain = root, 0, prior
        steps, dev_parts = [], []
        dev_len = host_len = 0
        while pos < len(key):
            child = node.children.get(first_page(key[pos:], self.page_size))
            if child is None or child.stale:
                # A failed load's device copy is garbage even while its request holds it: the
                # match ends before it (that part is computed again, never served).
                break
            n = common_pages(child.key, key[pos:], self.page_size)
            steps.append((child, n))
            if child.on_device:
                dev_parts.append(child.device if n == len(child) else child.device[:n])
                dev_len += n
            else:
                host_len += n
            if self.digests:
                chain = child.digests[n // self.page_size - 1]
            node, pos = child, pos + n
            if n < len(child):
                break
        probe_digests: tuple = ()
        if probe and self.digests and pos < len(key):
            probe_digests = tuple(page_digests(key[pos:], self.page_size, chain))
        device = torch.cat(dev_parts) if dev_parts else _EMPTY
        return TreeMatch(key, tuple(steps), device, dev_len, host_len, probe_digests, root, prior)

    def node_at(self, match: TreeMatch) -> tuple[TreeNode, TreeNode]:
        """(last device node, last node) of ``match`` as whole nodes: a node matched in part is
        split first (the only change). The root stands for an empty part. Call it once per
        match: after a split, ``match.steps`` names the back half."""
        # The identity's root joins the tree here (a caller may add children below it).
        last_dev = last = self._roots.adopt(match.prior, match.root)
        for node, n in match.steps:
            if n < len(node):
                node = self._split(node, n)
            last = node
            if node.on_device:
                last_dev = node
        return last_dev, last

    def touch(self, node: TreeNode) -> list[TreeNode]:
        """Count a hit on ``node`` and its ancestors (recency, frequency, selective
        write-through). Returns that path, root side first."""
        path = list(reversed(list(path_to_root(node))))
        for n in path:
            n.hit_count += 1
            self._mark(n)
            if n.on_device:
                self.device_policy.on_hit(n)
            if n.on_host:
                self.host_policy.on_hit(n)
        return path

    def holds_stale(self, node: TreeNode) -> bool:
        """Whether the path to ``node`` has a device copy from a failed load."""
        return any(n.stale for n in path_to_root(node))

    def subtree_free(self, node: TreeNode) -> bool:
        """Nothing below (or at) ``node`` is locked, protected or being copied."""
        return all(
            m.host_ref == 0 and m.lock_ref == 0 and not m.pending for m in [node, *walk(node)]
        )

    # -- inserting ------------------------------------------------------------------------------
    def insert(
        self,
        tokens,
        device_indices: torch.Tensor,
        *,
        windowless: bool = False,
        prior: bytes = b"",
    ) -> tuple[int, list[TreeNode], int]:
        """Record that ``tokens`` (whole pages) have KV in ``device_indices``. Returns (how many
        leading tokens were already on the device, the new nodes, how many leading tokens the
        tree now records). The caller frees its own slots for the duplicates and for the tokens
        after the recorded ones (the tree stops at a failed load's stale copy, so that nothing
        is kept below garbage). Host-only nodes on the way adopt the caller's slots.
        ``windowless``: the slots hold full KV only (sliding-window models): new nodes and
        host-only nodes adopting them become tombstones. ``prior``: the request's identity
        (see ``match``)."""
        key = self.aligned(tokens)
        if len(key) != len(tokens) or len(device_indices) != len(key):
            raise InvalidArgumentError(
                f"insert needs whole pages of page_size={self.page_size} and one slot per token; "
                f"got {len(tokens)} tokens and {len(device_indices)} slots"
            )
        node, pos, dup, new = self._roots.get(prior, create=True), 0, 0, []
        while pos < len(key):
            child = node.children.get(first_page(key[pos:], self.page_size))
            if child is not None and child.stale:
                return dup, new, pos
            if child is None:
                child = self.add_child(node, key[pos:])
                child.windowless = windowless
                self.set_device(child, device_indices[pos:])
                new.append(child)
                pos = len(key)
                break
            n = common_pages(child.key, key[pos:], self.page_size)
            if n < len(child):
                child = self._split(child, n)
            if child.on_device:
                dup = pos + n
            else:
                child.windowless = child.windowless or windowless
                self.set_device(child, device_indices[pos : pos + n])
            node, pos = child, pos + n
        return dup, new, pos

    def has_child(self, parent: TreeNode, key: tuple) -> bool:
        """Whether ``parent`` has a child starting with ``key``'s first page."""
        return first_page(key, self.page_size) in parent.children

    def add_child(self, parent: TreeNode, key: tuple) -> TreeNode:
        """A new node for ``key`` (whole pages, not yet in the tree) below ``parent``; it holds
        nothing until ``set_device`` / ``set_host``."""
        page = first_page(key, self.page_size)
        if page in parent.children:
            raise StateError(f"{parent!r} already has a child for the page {page[:8]}...")
        child = TreeNode(key, parent)
        if self.digests:
            child.digests = page_digests(key, self.page_size, parent.last_digest())
        parent.children[page] = child
        return child

    # -- residency ------------------------------------------------------------------------------
    def set_device(self, node: TreeNode, slots: torch.Tensor) -> None:
        if node.on_device or len(slots) != len(node):
            raise StateError(f"set_device on {node!r} with {len(slots)} slots")
        node.device = slots
        self.device_policy.on_insert(node)
        self._mark(node)
        self.device_tokens += len(node)
        if node.lock_ref == 0:
            self.evictable_device_tokens += len(node)

    def take_device(self, node: TreeNode) -> torch.Tensor:
        """Remove ``node``'s device copy; returns its slots (the caller frees them)."""
        slots = node.device
        if slots is None:
            raise StateError(f"take_device on {node!r}, which is not on the device")
        node.device = None
        node.stale = False
        self.device_policy.on_remove(node)
        self._mark(node)
        self._mark(node.parent)  # may be a device leaf now
        self.device_tokens -= len(node)
        if node.lock_ref == 0:
            self.evictable_device_tokens -= len(node)
        return slots

    def set_host(self, node: TreeNode, slots: torch.Tensor) -> None:
        if node.on_host or len(slots) != len(node):
            raise StateError(f"set_host on {node!r} with {len(slots)} slots")
        node.host = slots
        self.host_policy.on_insert(node)
        self._mark(node)
        self.host_tokens += len(node)

    def take_host(self, node: TreeNode) -> torch.Tensor:
        """Remove ``node``'s host copy (a node left with neither copy leaves the tree);
        returns its slots."""
        slots = node.host
        if slots is None:
            raise StateError(f"take_host on {node!r}, which is not on the host")
        node.host = None
        self.host_policy.on_remove(node)
        self.host_tokens -= len(node)
        if not node.on_device and node.parent is not None:
            self._unlink(node)
        return slots

    def detach(self, node: TreeNode) -> Released:
        """Remove ``node`` and everything below it; returns every slot they held."""
        dev, host, tokens = [], [], 0
        for m in [*walk(node), node]:
            if m.on_device:
                dev.append(self.take_device(m))
            if m.on_host:
                host.append(m.host)
                m.host = None
                self.host_policy.on_remove(m)
                self.host_tokens -= len(m)
            tokens += len(m)
        if node.parent is not None:
            self._unlink(node)
        return Released(dev, host, tokens)

    def _unlink(self, node: TreeNode) -> None:
        parent = node.parent
        del parent.children[first_page(node.key, self.page_size)]
        self._mark(parent)  # may be a leaf now
        node.parent = None
        self._roots.drop_if_bare(parent)  # an identity's root with nothing below it goes

    def mark_stale(self, node: TreeNode) -> None:
        """``node``'s device copy is garbage: a failed load's (its host copy, the source, stays)
        or a quarantined one (``tree.quarantine``: no host copy, it leaves the tree when freed)."""
        if not node.on_device:
            raise StateError(f"mark_stale on {node!r}, which is not on the device")
        node.stale = True

    def set_windowless(self, node: TreeNode) -> None:
        """``node``'s window KV was freed: a tombstone from now on (full KV only)."""
        node.windowless = True

    def set_in_storage(self, node: TreeNode) -> None:
        node.in_storage = True

    # -- locks ------------------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> None:
        for n in path_to_root(node):
            if n.lock_ref == 0 and n.on_device:
                self.evictable_device_tokens -= len(n)
            n.lock_ref += 1

    def dec_lock_ref(self, node: TreeNode) -> list[torch.Tensor]:
        """Unlock the path to ``node``. Returns device slots of stale copies (from failed loads)
        that nothing holds any more, deepest first: the caller frees them."""
        path = list(path_to_root(node))
        for n in path:
            if n.lock_ref <= 0:
                raise InvalidArgumentError(f"dec_lock_ref on unlocked {n!r}")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0 and n.on_device:
                self.evictable_device_tokens += len(n)
                self._mark(n)
        freed = []
        for n in path:  # deepest first, so device residency stays prefix-closed
            # A backup to storage reads the host copy only: it does not keep a stale device copy
            # (which nothing would free once the backup ended).
            device_busy = PendingKind.LOAD in n.pending or PendingKind.WRITE in n.pending
            if n.stale and n.lock_ref == 0 and n.on_device and not device_busy:
                if not any(c.on_device for c in n.children.values()):
                    freed.append(self.take_device(n))
                    if not n.on_host:  # quarantined: no good copy left, and no children
                        self._unlink(n)
        return freed

    def inc_host_ref(self, node: TreeNode) -> None:
        for n in path_to_root(node):
            n.host_ref += 1

    def dec_host_ref(self, node: TreeNode) -> None:
        path = list(path_to_root(node))
        for n in path:
            if n.host_ref <= 0:
                raise InvalidArgumentError(f"dec_host_ref on unprotected {n!r}")
        for n in path:
            n.host_ref -= 1
            if n.host_ref == 0:
                self._mark(n)

    # -- copies in flight -----------------------------------------------------------------------
    def begin_job(self, job_id: JobId, kind: PendingKind, nodes: list[TreeNode]) -> None:
        """Mark ``nodes`` as touched by job ``job_id`` (splits keep the mark on both halves)."""
        self._jobs[job_id] = (kind, list(nodes))
        for n in nodes:
            n.pending[kind] = job_id

    def end_job(self, job_id: JobId) -> list[TreeNode]:
        """Clear job ``job_id``'s marks; returns the nodes it touched (split halves included)."""
        kind, nodes = self._jobs.pop(job_id)
        for n in nodes:
            if n.pending.get(kind) == job_id:
                del n.pending[kind]
                self._mark(n)
        return nodes

    def job_nodes(self, job_id: JobId) -> list[TreeNode]:
        """The nodes job ``job_id`` touches ([] for a job the tree does not know)."""
        entry = self._jobs.get(job_id)
        return list(entry[1]) if entry is not None else []

    @property
    def num_jobs(self) -> int:
        return len(self._jobs)

    # -- splitting ------------------------------------------------------------------------------
    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut ``node`` after ``at`` tokens (whole pages, 0 < at < len); returns the new parent
        holding the front part. Every per-token and per-page field is cut at the same page
        boundary; pending marks and policy records are copied to the front."""
        parent, ps = node.parent, self.page_size
        if parent is None or not 0 < at < len(node.key) or at % ps:
            raise StateError(f"cannot split {node!r} after {at} tokens (page_size={ps})")
        front = TreeNode(node.key[:at], parent)
        front.device = node.device[:at] if node.device is not None else None
        front.host = node.host[:at] if node.host is not None else None
        pages = at // ps
        front.digests = node.digests[:pages]
        front.in_storage = node.in_storage
        front.lock_ref = node.lock_ref
        front.host_ref = node.host_ref
        front.pending = dict(node.pending)
        front.hit_count = node.hit_count
        front.stale = node.stale  # a failed load's device copy is garbage in both halves
        front.windowless = node.windowless
        for job_id in node.pending.values():
            self._jobs[job_id][1].append(front)
        node.key = node.key[at:]
        node.device = node.device[at:] if node.device is not None else None
        node.host = node.host[at:] if node.host is not None else None
        node.digests = node.digests[pages:]
        parent.children[first_page(front.key, ps)] = front
        front.children[first_page(node.key, ps)] = node
        node.parent = front
        if node.on_device:
            self.device_policy.on_split(node, front)
        if node.on_host:
            self.host_policy.on_split(node, front)
        self._mark(front)  # the back half's evictability and order are unchanged
        return front
