"""RecurrentState: what a hybrid model (full attention plus recurrent layers) changes in the cache.

A prefix of k pages is a hit only with its KV pages *and* the recurrent state after page k, so:

- **Where snapshots are taken.** At ``finish``, at the end of the request's cached prefix (its
  last whole page): that is where the same conversation's next turn resumes. And while it runs,
  every ``every`` pages (``DeviceConfig.state_snapshot_every``), so requests that share a long
  prompt but not its end (a system prompt, a document) hit its snapshot points. Not at every
  page: one state is often larger than a page of KV. The engine tells the cache where its state
  is (``track``): at each page boundary the request's state is copied into one of its tracking
  slots (ping-pong between two under overlap scheduling), and the cache takes the snapshot at
  ``finish`` from there; without tracking slots only a sequence that ends on a page boundary
  leaves one.
- **The hit rule** (``trim``): a match is cut back to the deepest page whose snapshot some tier
  holds (device, host, or the store: probed deepest first, at most ``probe_limit`` probes). A
  branch off the middle of a cached prefix is therefore recomputed from the deepest snapshot
  before the branch point (possibly from the start).
- **Restoring** (``settle``): after ``begin`` has locked a prefix (its loads and prefetches may
  have given less than the match), the request's fresh state slot is filled from the snapshot at
  the end of the granted prefix; where that snapshot cannot be had (evicted meanwhile, a store
  miss or a corrupted value), the grant is cut back to the next shallower one that can, down to
  no prefix with a zeroed state. A state that cannot be proven to be the one written is a miss.
"""

from __future__ import annotations

import torch

from tiered_kv.cache import lifecycle
from tiered_kv.cache.prefix_match import StorageHit
from tiered_kv.cache.state_ledger import StateLedger
from tiered_kv.device.hybrid_req_pool import HybridReqToTokenPool, HybridRequestKV
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import PendingKind
from tiered_kv.storage.keys import digest_of, page_digests
from tiered_kv.tree.node import path_to_root
from tiered_kv.tree.tiered_tree import TieredTree, TreeMatch


def _prefix_proven(manager, req) -> bool:
    """Whether every load into ``req``'s prefix has been acknowledged ok (none in flight, none
    failed); without a manager, whether the request's node is not stale."""
    if manager is None:
        return not req.node.stale
    manager.poll()
    in_flight = any(PendingKind.LOAD in n.pending for n in path_to_root(req.node))
    return not in_flight and not manager.holds_stale(req.node)


class RecurrentState:
    def __init__(
        self,
        ledger: StateLedger,
        req_pool: HybridReqToTokenPool,
        page_size: int,
        every: int = 0,
        probe_limit: int = 8,
    ) -> None:
        """``req_pool``: the ``HybridReqToTokenPool`` whose rows own the requests' state
        slots; ``every``: also snapshot a running request every this many pages (0: never);
        ``probe_limit``: the most store probes one match spends on snapshots."""
        self.ledger = ledger
        self.req_pool = req_pool
        self.page_size = page_size
        self.every = every
        self.probe_limit = probe_limit
        self.counts = ledger.counts

    # -- the hit rule -------------------------------------------------------------------------
    def _deepest(self, digests: list[bytes], probe: bool = True) -> int:
        """Pages of the longest prefix of this chain whose end has a snapshot somewhere."""
        held = 0
        for k in range(len(digests), 0, -1):
            if self.ledger.held(digests[k - 1]) is not None:
                held = k
                break
        if probe:
            for k in range(len(digests), held, -1)[: self.probe_limit]:
                if self.ledger.stored(digests[k - 1]):
                    return k
        return held

    def trim(
        self, tree: TieredTree, tokens, m: TreeMatch, hit: StorageHit, count: bool = True
    ) -> tuple[TreeMatch, StorageHit]:
        """The tree match and storage hit cut back to the deepest page with a snapshot."""
        ps = self.page_size
        digests = [d for node, n in m.steps for d in node.digests[: n // ps]]
        tree_pages = len(digests)
        digests += [digest_of(k) for k in hit.keys]
        best = self._deepest(digests)
        if count:
            self.counts.trimmed_tokens += (len(digests) - best) * ps
        if best >= tree_pages:
            return m, StorageHit(hit.keys[: best - tree_pages])
        return tree.match(list(tokens)[: best * ps], probe=False, prior=m.prior), StorageHit([])

    # -- a request's state --------------------------------------------------------------------
    def settle(self, manager, grant: lifecycle.PrefixGrant, tokens, state_slot: int):
        """Fill device state slot ``state_slot`` (the request's own, zeroed) with the state at
        the end of ``grant``'s prefix, cutting the grant back where that cannot be had.
        Returns the grant to use (``grant`` itself, or a shorter one)."""
        ps = self.page_size
        while grant.prefix_len:
            digests = [d for n in reversed(list(path_to_root(grant.node))) for d in n.digests]
            digests = digests[: grant.prefix_len // ps]
            k = len(digests)
            if self.ledger.restore(digests[-1], state_slot) is not None:
                return grant
            k = self._deepest(digests[:-1], probe=True)
            self.counts.trimmed_tokens += (grant.prefix_len - k * ps) if k else grant.prefix_len
            grant = lifecycle.cut_back(manager, grant, tokens, k * ps)
        self.req_pool.mamba_pool.clear_slots(torch.tensor([state_slot], dtype=torch.int64))
        return grant

    def track(self, req, position: int, manager=None) -> None:
        """The engine's forward of ``req`` has just absorbed token ``position - 1`` in every
        recurrent layer (``position`` a page boundary): keep that state in a tracking slot (and
        a snapshot, at a ``every``-th page). ``manager``: the snapshot is taken only once the
        loads of the request's prefix are known to have landed whole (a state computed over a
        failed load's garbage KV must never be kept where another request could restore it)."""
        ps = self.page_size
        if (
            isinstance(position, bool)
            or not isinstance(position, int)
            or position % ps
            or not (0 < position <= len(req.tokens))
        ):
            raise InvalidArgumentError(
                f"position={position!r} must be a multiple of page_size={ps} in "
                f"1..{len(req.tokens)} (the request's tokens)"
            )
        kv = req.kv
        req.state_position = position
        pages = position // ps
        if (
            self.every
            and pages % self.every == 0
            and position > req.prefix_len
            and _prefix_proven(manager, req)
        ):
            # Named by its page's digest: it becomes a hit once those pages are in the tree.
            digest = page_digests(req.tokens[:position], ps, req.prior)[-1]
            self.ledger.capture(digest, kv.mamba_pool_idx)
        if any(s < 0 for s in kv.mamba_tracking):  # a lazily deferred slot: take it now
            self.req_pool.ensure_tracking_slots(kv)  # (short of slots: go on with the one)
        tracking = [s for s in kv.mamba_tracking if s >= 0]
        if tracking:
            slot = tracking[req.state_turn % len(tracking)]
            req.state_turn += 1
            req.state_slot_at = None  # until the copy is whole
            try:
                self.req_pool.mamba_pool.copy_from(
                    torch.tensor([kv.mamba_pool_idx]), torch.tensor([slot])
                )
            except Exception:  # noqa: BLE001 - a failed copy tracks nothing: no snapshot
                self.counts.errors += 1
                return
            req.state_slot_at = (position, slot)
        else:
            req.state_slot_at = (position, kv.mamba_pool_idx)

    def capture(self, req, tokens, manager=None) -> bool:
        """At ``finish`` (after its pages went into the tree): a snapshot of the state at the
        end of the request's cached prefix, if the engine tracked it there and every load of
        its prefix is known to have landed whole."""
        full = len(tokens) - len(tokens) % self.page_size
        at = getattr(req, "state_slot_at", None)
        if not full or at is None or at[0] != full or not _prefix_proven(manager, req):
            return False
        slot = at[1]
        # The working slot holds the state at ``full`` only while nothing was computed after.
        if slot == req.kv.mamba_pool_idx and req.state_position != len(tokens):
            return False
        chain = page_digests(tokens[:full], self.page_size, getattr(req, "prior", b""))
        return self.ledger.capture(chain[-1], slot)

    # -- rows, housekeeping -------------------------------------------------------------------
    def alloc_row(self):
        """A request row with its own zeroed state slot (and tracking slots), evicting device
        snapshots when state slots are short. None when no row (or state slot) can be had."""
        kv = HybridRequestKV()
        if self.req_pool.alloc([kv]) is not None:
            return kv
        if self.req_pool.available_size() == 0:
            return None
        self.ledger.free_device_slots(1 + self.req_pool.initial_tracking_slots)
        return kv if self.req_pool.alloc([kv]) is not None else None

    def evict_all(self) -> None:
        """Every device snapshot down to host, every host one down to the store."""
        self.ledger.drop_device(list(self.ledger.snaps))
        self.ledger.drop_host(list(self.ledger.snaps))

    def close(self) -> None:
        if self.ledger.store is not None:
            self.ledger.store.close()
