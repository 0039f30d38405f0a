"""HiSparseServing: a DSA cache's sparse requests, every token on host, a fixed device buffer.

On a cache built with ``DeviceConfig.hisparse_logical_ratio`` (its device allocator is a
``HiSparseTokenToKVPoolAllocator``: logical slots for every token, device slots for some) a
sparse request runs as follows:

- ``begin``: its cached prefix is brought to host and protected there (``hisparse_prefix``: a
  storage hit prefetched to host, device-only nodes written to host). The request takes a
  logical slot with a device slot for every prompt token (its prefill's staging rows) and host
  slots for the tokens after the prefix; the prefix's latents and indexer keys are copied from
  host into the staging rows (the prefill attends to them). A copy that fails is a counted miss:
  the request computes its whole prompt instead;
- the model computes the rest of the prompt into ``req.staging`` (``cache.write_kv`` /
  ``write_index_k`` with ``req.logical``, or the pool at the staging rows);
- ``admit``: the computed tokens are backed up to the request's host slots, every token's
  indexer key kept on the device (``HiSparseIndexKeys``), and the staging rows become the
  request's fixed buffer (``HiSparseSwapper``); from then on each layer's selected tokens are
  swapped in from host (``swap_in``), the tree's host copies serving the prefix;
- decode: ``begin_token`` (a logical slot, a host slot, the reserved device slot), the model
  writes the token there, ``commit_token`` backs it up;
- ``finish``: the committed tokens' whole pages after the prefix go into the tree as host-only
  nodes (backed up to storage per the write policy), everything else is given back; ``abort``
  gives back without inserting.

Device memory per running request is its buffer plus a page, whatever its context; a prefill
needs staging rows for its prompt while it runs. Failed copies and a full host or device are
counted (``counts``) and answered with None / False, never with another token's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tiered_kv._checks import check_positive_int
from tiered_kv.cache.facade import TieredKVCache
from tiered_kv.cache.hisparse_prefix import HostPrefix, find_on_host
from tiered_kv.cache.metrics import RequestHits
from tiered_kv.device.allocator.hisparse import HiSparseTokenToKVPoolAllocator
from tiered_kv.device.hisparse_index import HiSparseIndexKeys
from tiered_kv.errors import InvalidArgumentError, StateError
from tiered_kv.host.hisparse_swap import HiSparseSwapper, SwapIn
from tiered_kv.names import WritePolicy
from tiered_kv.storage.keys import extra_key_prior

COUNTS = (
    "begun", "refused_device", "refused_host", "prefix_tokens", "prefix_load_failed",
    "admitted", "admit_failed", "admit_no_room", "commit_failed", "finished", "aborted",
    "inserted_tokens", "swap_hits", "swap_loaded", "swap_failed",
)  # fmt: skip


@dataclass
class SparseRequest:
    tokens: list[int]  # tokens with KV (or being computed): the prompt, then decoded ones
    prior: bytes
    prefix: HostPrefix  # the tree's part, protected on host
    logical: torch.Tensor  # the request's logical slot per position
    host_slots: torch.Tensor  # host slot per position (CPU); the prefix's are the tree's
    own_host: torch.Tensor  # host slots the request allocated (whole pages)
    staging: torch.Tensor | None  # device row per prompt position until ``admit``
    swapper: HiSparseSwapper | None = None
    done: bool = False
    hits: RequestHits = field(default_factory=RequestHits)

    @property
    def prefix_len(self) -> int:
        return self.prefix.length


class HiSparseServing:
    """Sparse requests over ``cache`` (see the module doc)."""

    def __init__(
        self, cache: TieredKVCache, buffer_tokens: int, *, copy_mode: str = "auto"
    ) -> None:
        allocator = cache.allocator
        if not isinstance(allocator, HiSparseTokenToKVPoolAllocator):
            raise InvalidArgumentError(
                "HiSparseServing needs a cache built with DeviceConfig.hisparse_logical_ratio "
                f">= 1 (model='dsa'); this one has a {type(allocator).__name__}"
            )
        ps = cache.config.device.page_size
        check_positive_int("buffer_tokens", buffer_tokens)
        if buffer_tokens % ps:
            raise InvalidArgumentError(
                f"buffer_tokens={buffer_tokens} must be a multiple of page_size={ps}"
            )
        self.cache, self.manager, self.allocator = cache, cache.manager, allocator
        self.pool, self.host = cache.device_pool, cache.host_pool
        self.page_size, self.buffer_tokens, self.copy_mode = ps, buffer_tokens, copy_mode
        self.index_keys = HiSparseIndexKeys(allocator, self.pool)
        self.counts = dict.fromkeys(COUNTS, 0)
        self.live: set[int] = set()  # ids of requests not finished or aborted

    # -- begin and prefill --------------------------------------------------------------------
    def begin(self, tokens, extra_key: str | bytes | None = None) -> SparseRequest | None:
        """A request for prompt ``tokens`` staged for its prefill (positions
        ``req.prefix_len ..`` to compute at ``req.staging``), or None when the device, host or
        logical slots are short (nothing held; try later)."""
        prompt = self.cache._prompt(tokens)  # noqa: SLF001 - the facade's own prompt check
        prior = extra_key_prior(extra_key)
        p = self.cache.config.policies
        m, n = self.manager, len(prompt)
        prefix = find_on_host(m, prompt[:-1], n, prior, p.prefetch_threshold, p.prefetch_wait_s)
        logical = self._prompt_slots(n)
        own = None if logical is None else self._host_pages(n - prefix.length, prefix)
        if logical is None or own is None:
            if logical is not None:
                self.allocator.free(logical)
            self._unprotect(prefix)
            self.counts["refused_device" if logical is None else "refused_host"] += 1
            return None
        if prefix.length:
            try:
                self.host.load_to_device_all_layer(
                    self.pool, prefix.host_slots, logical[: prefix.length]
                )
            except Exception:  # noqa: BLE001 - a failed copy is a counted miss: compute it all
                self.counts["prefix_load_failed"] += 1
                self.host.free(own)
                self._unprotect(prefix)
                prefix = HostPrefix(prefix.node, prefix.host_slots[:0], prefix.hits, False)
                own = self._host_pages(n, prefix)
                if own is None:
                    self.allocator.free(logical)
                    self.counts["refused_host"] += 1
                    return None
        hits = prefix.hits if prefix.length else RequestHits(n, 0, 0, 0, n)
        req = SparseRequest(
            list(prompt), prior, prefix, logical,
            torch.cat([prefix.host_slots, own[: n - prefix.length].to(torch.int64)]),
            own, self.allocator.translate_loc(logical.to(torch.int64)), hits=hits,
        )  # fmt: skip
        self.cache.metrics.hits.add(hits)
        self.counts["begun"] += 1
        self.counts["prefix_tokens"] += prefix.length
        self.live.add(id(req))
        return req

    def admit(self, req: SparseRequest) -> bool:
        """After the prefill wrote positions ``req.prefix_len ..`` of the prompt: back them up,
        keep every indexer key on the device and turn the staging rows into the buffer. False
        when a copy failed or the device has no room for the buffer (the request stays staged:
        admit again, or abort)."""
        self._check(req, staged=True)
        for attempt in range(2):
            try:
                sw = HiSparseSwapper.admit(
                    self.allocator, self.pool, self.host, self.index_keys, req.logical,
                    req.host_slots, self.buffer_tokens, copy_mode=self.copy_mode,
                    backed_up=req.prefix_len,
                )  # fmt: skip
            except (InvalidArgumentError, StateError):
                raise
            except Exception:  # noqa: BLE001 - a failed backup: counted, the request stays staged
                self.counts["admit_failed"] += 1
                return False
            if sw is not None:
                break
            if attempt == 0:  # the tree's device copies make room for the buffer
                self.manager.make_device_room(self.buffer_tokens + self.page_size)
        else:
            self.counts["admit_no_room"] += 1
            return False
        req.swapper, req.staging = sw, None
        self.counts["admitted"] += 1
        return True

    # -- decode ---------------------------------------------------------------------------------
    def begin_token(self, req: SparseRequest, token: int) -> torch.Tensor | None:
        """Start decode token ``token``: returns the device slot its latent and indexer key are
        written at, or None when logical or host slots are short (nothing changed)."""
        self._check(req, staged=False)
        pos = len(req.tokens)
        seq = torch.tensor([pos + 1], dtype=torch.int64)
        lg = self.allocator.alloc_decode(seq.to(self.allocator.device), seq, req.logical[-1:])
        if lg is None:
            return None
        mine = pos - req.prefix_len
        if mine >= len(req.own_host):
            more = self._host_pages(1, req.prefix)
            if more is None:
                self.allocator.free(lg)
                return None
            req.own_host = torch.cat([req.own_host, more])
        slot = req.swapper.begin_token(lg, req.own_host[mine : mine + 1].to(torch.int64))
        req.tokens.append(int(token))
        req.logical = torch.cat([req.logical, lg.to(req.logical.dtype)])
        req.host_slots = torch.cat([req.host_slots, req.own_host[mine : mine + 1]])
        return slot

    def commit_token(self, req: SparseRequest) -> bool:
        """Back the newest token up; False when the copy failed (commit it again)."""
        self._check(req, staged=False)
        try:
            req.swapper.commit_token()
        except (InvalidArgumentError, StateError):
            raise
        except Exception:  # noqa: BLE001 - a failed backup is counted; the token stays pending
            self.counts["commit_failed"] += 1
            return False
        return True

    def swap_in(self, req: SparseRequest, layer_id: int, positions: torch.Tensor) -> SwapIn:
        return self.swapper(req).swap_in(layer_id, positions)

    def swapper(self, req: SparseRequest) -> HiSparseSwapper:
        """The admitted live request's swapper (StateError otherwise): a forward that swaps
        every layer in checks the request once and calls it per layer."""
        self._check(req, staged=False)
        return req.swapper

    def score_keys(self, req: SparseRequest, layer_id: int) -> torch.Tensor:
        self._check(req, staged=False)
        return req.swapper.score_keys(layer_id)

    # -- the end --------------------------------------------------------------------------------
    def finish(self, req: SparseRequest) -> int:
        """Insert the committed tokens' whole pages after the prefix into the tree (host-only
        nodes) and give everything back. Returns the tokens inserted."""
        self._check(req, staged=False)
        committed = len(req.tokens) - (req.swapper.newest is not None)
        got = self._insert(req, committed - committed % self.page_size)
        self._release(req)
        self.counts["finished"] += 1
        self.counts["inserted_tokens"] += got
        return got

    def abort(self, req: SparseRequest) -> None:
        """Give everything back, inserting nothing."""
        self._check(req, staged=None)
        self._release(req)
        self.counts["aborted"] += 1

    def _insert(self, req: SparseRequest, full: int) -> int:
        """Host-only nodes for ``req``'s tokens ``[matched, full)`` (whole pages) under the
        tree's match of them; the request's host slots they take are marked -1 in
        ``req.own_host`` (kept by the tree)."""
        tree, m = self.manager.tree, self.manager
        if full <= req.prefix_len:
            return 0
        key = req.tokens[:full]
        match = tree.match(key, probe=False, prior=req.prior)
        _, last = tree.node_at(match)
        start = match.length
        if start >= full or tree.has_child(last, tuple(key[start:])):
            return 0  # the tree has them already (or stops before a failed load's copy)
        if start < req.prefix_len:  # the prefix's nodes went (they were only protected)
            return 0
        child = tree.add_child(last, tuple(key[start:]))
        own = req.own_host[start - req.prefix_len : full - req.prefix_len]
        tree.set_host(child, own.clone())
        req.own_host[start - req.prefix_len : full - req.prefix_len] = -1
        if m.write_policy is not WritePolicy.WRITE_BACK:
            m.backup_to_storage(child)
        return full - start

    def _release(self, req: SparseRequest) -> None:
        sw = req.swapper
        if sw is not None:
            self.counts["swap_hits"] += sw.num_hits
            self.counts["swap_loaded"] += sw.num_loaded
            self.counts["swap_failed"] += sw.num_failed
            sw.release()
        mine = req.own_host[req.own_host >= 0]
        if mine.numel():
            self.host.free(mine)
        self.allocator.free(req.logical)  # and the staging rows' device slots, if still held
        self._unprotect(req.prefix)
        req.done = True
        self.live.discard(id(req))

    # -- helpers --------------------------------------------------------------------------------
    def _prompt_slots(self, n: int) -> torch.Tensor | None:
        """A logical slot with a device slot for each of ``n`` prompt tokens (the tree's
        device copies evicted for room if needed); None when the device stays short."""
        need = -(-n // self.page_size) * self.page_size
        if self.allocator.available_size() < need:
            self.manager.make_device_room(need)
        dev = self.allocator.device
        z, seq = torch.zeros(1, dtype=torch.int64), torch.tensor([n], dtype=torch.int64)
        last = torch.full((1,), -1, dtype=torch.int64, device=dev)
        return self.allocator.alloc_extend(z.to(dev), z, seq.to(dev), seq, last, n)

    def _host_pages(self, n: int, prefix: HostPrefix) -> torch.Tensor | None:
        """Host slots for ``n`` tokens in whole pages (at least one), never evicting the
        prefix's path."""
        ps = self.page_size
        pages = max(1, -(-n // ps))
        out = self.manager.alloc_host(pages * ps, protect=prefix.node)
        return None if out is None else out.to(torch.int64)

    def _unprotect(self, prefix: HostPrefix) -> None:
        if prefix.protected:
            self.manager.dec_host_ref(prefix.node)
            prefix.protected = False

    def _check(self, req: SparseRequest, staged: bool | None) -> None:
        if not isinstance(req, SparseRequest) or id(req) not in self.live or req.done:
            raise StateError("not a live sparse request of this HiSparseServing")
        if staged is True and req.swapper is not None:
            raise StateError("this request was admitted already")
        if staged is False and req.swapper is None:
            raise StateError("this request is not admitted yet; call admit after its prefill")
