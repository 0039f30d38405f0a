"""Storage -> host prefetch for :class:`TieredRadixCache` (a mixin over its tree and pools).

``start_prefetch`` takes host slots for a match's storage hit (as many pages as the host can
hold, halving on shortage) and starts the controller's background prefetch, protecting the
matched path meanwhile; ``finish_prefetch`` waits per the caller's policy (None: until done, 0:
not at all, else up to that many seconds), cancels the rest, waits for the batch in progress
(its host slots are about to be used), and attaches the pages that arrived as host-only nodes
(already in storage). Slots for pages that did not arrive, or that the tree gained meanwhile,
are freed; if the matched prefix left the tree meanwhile, everything is freed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tiered_kv.radix_tree import PendingOp as _Op
from tiered_kv.radix_tree import TreeNode, first_page
from tiered_kv.storage.keys import page_digests

if TYPE_CHECKING:
    from tiered_kv.tiered_radix_cache import MatchResult


class TierPrefetch:
    # -- storage -> host ----------------------------------------------------------------------
    def start_prefetch(self, match: MatchResult, tokens) -> _Op | None:
        """Start loading ``match``'s storage hit into host slots (as many pages as the host can
        hold). Returns the operation, to pass to ``finish_prefetch``."""
        if not match.storage_keys or self.storage is None:
            return None
        node = match.last_node
        pages = len(match.storage_keys)
        self.inc_lock_ref(node)
        self.inc_host_ref(node)
        host = self._alloc_host(pages * self.page_size)
        while host is None and pages > 1:
            pages //= 2
            host = self._alloc_host(pages * self.page_size)
        if host is None:
            self.dec_lock_ref(node)
            self.dec_host_ref(node)
            self.host_counters.writes_skipped += 1
            return None
        start = match.device_hit_length + match.host_hit_length
        key = self._aligned(tokens)[: start + pages * self.page_size]
        op_id = next(self._op_ids)
        op = _Op("prefetch", [], lock_node=node, extra=(key, start, host))
        op.handle = self._storage_call(
            lambda: self.controller.prefetch(match.storage_keys[:pages], host, op_id), None
        )
        if op.handle is None:
            self._end_prefetch(op, 0)
            return None
        self._ops[op_id] = op
        return op

    def finish_prefetch(self, op: _Op, timeout_s: float | None) -> int:
        """Wait up to ``timeout_s`` (None: until done, 0: not at all), stop the rest, and put
        the pages that arrived into the tree as host-only nodes. Returns tokens gained."""
        handle = op.handle
        if timeout_s is None or timeout_s > 0:
            handle.done.wait(timeout_s)
        handle.cancel()
        handle.done.wait()  # at most the batch in progress; its host slots are about to be used
        if handle.error is not None:
            self.storage_errors += 1
        self._ops = {k: v for k, v in self._ops.items() if v is not op}
        return self._end_prefetch(op, handle.pages_done)

    def _end_prefetch(self, op: _Op, pages_done: int) -> int:
        key, start, host = op.extra
        self.dec_lock_ref(op.lock_node)
        self.dec_host_ref(op.lock_node)
        got = pages_done * self.page_size
        if got < len(host):
            self.host_pool.free(host[got:])
        if got == 0:
            return 0
        return self._insert_host(key[: start + got], start, host[:got])

    def _insert_host(self, key: tuple, start: int, host: torch.Tensor) -> int:
        """Attach host slots for ``key[start:]`` below the path of ``key[:start]``; slots for
        tokens the tree already holds (or cannot attach) are freed. Returns tokens attached."""
        node, pos = self.root, 0
        for child, n in self._descend(key):
            node, pos = child, pos + n
        if pos < start:  # the prefix left the tree meanwhile
            self.host_pool.free(host)
            return 0
        if pos > start:
            self.host_pool.free(host[: pos - start])
        if pos == len(key):
            return 0
        child = TreeNode(key[pos:], node)
        child.host = host[pos - start :]
        child.digests = page_digests(child.key, self.page_size, node.last_digest())
        child.in_storage = True
        node.children[first_page(child.key, self.page_size)] = child
        self.host_policy.on_insert(child)
        return len(child)
