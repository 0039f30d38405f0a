"""The connector's worker half for hybrid models: one ``ConnectorTiers`` per KV cache group this
rank holds layers of (a pipeline stage may hold none of a group), loads always async.

- Loads: a request's load is one per group, each on its group's load thread; the request is
  finished when every part is, and failed when any part could not fill every block it was
  given (or the scheduler sent it ``doomed``). Failures are reported per request
  (``transfer_results``: vLLM's ``failed_recving``), never per block: vLLM raises on block-level
  load errors with several groups, and recomputes a failed request from its start.
- Saves of attention groups: as in ``WorkerSide``, copied layer by layer inside the forward
  (``save_kv_layer``), named and written at ``wait_for_save``.
- Saves of recurrent state: copied whole at ``wait_for_save``, after the step's forward.
  vLLM offers a boundary's block when it schedules the tokens that end at the boundary (its
  ``cache_blocks`` runs at allocation), so the state is written by the very forward of the
  step that carries the offer: copied before it, the bytes would be whatever the block held
  (zeros, or a state of an earlier request); after it, they are the state at the boundary, and
  no later step writes the block (the running state moves on in another block).
  Linear-attention layers never call ``save_kv_layer``.
"""

from __future__ import annotations

from concurrent.futures import Future

from tiered_kv.integrations.vllm.metadata import BlockPages, TieredKVMetadata
from tiered_kv.integrations.vllm.tiers import ConnectorTiers, SaveCopy
from tiered_kv.integrations.vllm.worker_side import wait_if_idle


def _done() -> Future:
    f: Future = Future()
    f.set_result(set())
    return f


class HybridWorkerSide:
    def __init__(self, tiers: dict[int, ConnectorTiers]) -> None:
        self.tiers = tiers
        self._layer_of = {
            name: (g, i) for g, t in tiers.items() for i, name in enumerate(t.layout.layer_names)
        }
        self._loads: dict[str, list[Future]] = {}
        self._doomed: set[str] = set()
        self._pending: dict[int, list[BlockPages]] = {}  # the step's saves, by group
        self._states: list[BlockPages] = []  # the step's state saves, copied after its forward
        self._saves: dict[int, SaveCopy] = {}
        self._writes: list[Future] = []
        self._idle = False  # this step computes nothing (vLLM's no-forward step)

    # -- loads ------------------------------------------------------------------------------
    def start_load_kv(self, meta: TieredKVMetadata, idle: bool = False) -> None:
        """Start the step's loads; ``idle``: the step computes nothing (``IDLE_WAIT_S``)."""
        self._idle = idle
        for req_id in meta.doomed:
            self._doomed.add(req_id)
            self._loads.setdefault(req_id, []).append(_done())
        for ld in meta.loads:
            tiers = self.tiers.get(ld.group)
            part = tiers.submit_load(ld.blocks, ld.digests) if tiers and ld.blocks else _done()
            self._loads.setdefault(ld.req_id, []).append(part)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are async: a request runs only after vLLM was told its load finished."""

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """(requests whose load finished, those of them that failed on this rank). In a step
        with nothing to compute, first waits up to ``IDLE_WAIT_S`` for a load in flight."""
        wait_if_idle(self._idle, (f for parts in self._loads.values() for f in parts))
        finished, failed = set(), set()
        for req_id, parts in list(self._loads.items()):
            if not all(f.done() for f in parts):
                continue
            del self._loads[req_id]
            finished.add(req_id)
            if req_id in self._doomed or any(f.result() for f in parts):
                failed.add(req_id)
            self._doomed.discard(req_id)
        return finished, failed

    # -- saves ------------------------------------------------------------------------------
    def begin_saves(self, meta: TieredKVMetadata) -> None:
        """The step's saves noted: attention groups' slots are taken at their group's first
        layer saved, recurrent states are copied at ``wait_for_save``."""
        self._pending, self._saves = {}, {}
        for s in meta.saves:
            if s.group in self.tiers:
                self._pending.setdefault(s.group, []).append(s)
        self._states = [s for s in meta.state_saves if s.group in self.tiers]

    def _started(self, group: int) -> SaveCopy | None:
        pending = self._pending.pop(group, None)
        if pending:
            blocks = [b for s in pending for b in s.blocks]
            digests = [d for s in pending for d in s.digests]
            self._saves[group] = self.tiers[group].begin_save(blocks, digests)
        return self._saves.get(group)

    def save_kv_layer(self, layer_name: str) -> None:
        where = self._layer_of.get(layer_name)
        if where is None:
            return
        group, layer = where
        save = self._started(group)
        if save is not None:
            self.tiers[group].copy_layer(save, layer)

    def wait_for_save(self) -> None:
        for group in list(self._pending):
            self._started(group)
        for group, save in self._saves.items():
            self._finish(self.tiers[group], save)
        self._saves = {}
        # Hazard: the forward that just ran wrote these states; they are final now.
        for s in self._states:
            tiers = self.tiers[s.group]
            self._finish(tiers, tiers.begin_save(s.blocks, s.digests))
        self._states = []
        self._writes = [f for f in self._writes if not f.done()]

    def _finish(self, tiers: ConnectorTiers, save: SaveCopy) -> None:
        future = tiers.finish_save(save)
        if future is not None:
            self._writes.append(future)

    def shutdown(self) -> None:
        for parts in self._loads.values():
            for f in parts:
                f.result()
        for f in self._writes:
            f.result()
        for tiers in self.tiers.values():
            tiers.close()
