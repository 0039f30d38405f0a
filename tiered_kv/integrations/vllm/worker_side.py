"""The connector's worker half: the step's loads and saves run against the engine's tiers.

- Async loads (``load_mode: async``): each request's load runs on the tiers' load thread between
  scheduler steps; ``get_finished`` reports the requests whose load is done, and the blocks that
  could not be loaded are handed to vLLM (``load_errors``) in the same pass, so vLLM recomputes
  them before the request runs.
- Layer-wise loads (``load_mode: layerwise``): the step's loads run on the load thread while
  the forward starts; ``wait_for_layer_load`` holds a layer's attention until that layer's
  blocks are in place (the hazard: attention reading a block before its bytes land). Failed
  blocks are reported after the forward; vLLM discards that step's output for their requests
  and recomputes them.
- Saves: ``save_kv_layer`` copies the layer's newly full blocks to host slots right after the
  layer's attention wrote them (the slots are taken at the first layer saved, so the step's
  layer-wise loads take theirs first); ``wait_for_save`` copies any layer not seen, names the slots
  and hands them to the store's write thread. The copy to the host is done before the step
  returns, so vLLM may reuse the blocks at once: no block outlives its request for a save
  (``request_finished`` never delays a free).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait

from tiered_kv.integrations.vllm.metadata import TieredKVMetadata
from tiered_kv.integrations.vllm.tiers import ConnectorTiers, SaveCopy

LAYER_WAIT_S = 600.0  # a layer's load is bounded by the store's own timeouts long before this
# In a step with nothing to compute vLLM asks for finished loads right after starting them and
# then steps again at once: its engine loop runs Python without a pause and takes the GIL from
# the load thread at every release. Such a step waits this long for a load in flight to finish,
# the GIL released, instead: a request that arrives meanwhile is scheduled at most this late.
IDLE_WAIT_S = 0.002


_UNSAID = object()


def idle_step(forward_context: object) -> bool:
    """Whether vLLM's forward context is that of a step without a forward (nothing scheduled:
    vLLM sets a context whose ``attn_metadata`` is None); a context that does not say is taken
    as a forward's."""
    return getattr(forward_context, "attn_metadata", _UNSAID) is None


def wait_if_idle(idle: bool, futures: Iterable[Future]) -> None:
    """In a step with nothing to compute (``idle``), wait up to ``IDLE_WAIT_S`` for the first
    of ``futures`` to finish; otherwise return at once."""
    pending = [f for f in futures if not f.done()]
    if idle and pending:
        wait(pending, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)


class WorkerSide:
    def __init__(self, tiers: ConnectorTiers, load_async: bool) -> None:
        self.tiers = tiers
        self.load_async = load_async
        self._layer_of = {name: i for i, name in enumerate(tiers.layout.layer_names)}
        self._async: dict[str, Future] = {}
        self._errors: set[int] = set()
        self._layer_events: list[threading.Event] = []
        self._sync_load: Future | None = None
        self._saves: list[SaveCopy] = []
        self._pending: list[tuple[int, bytes]] = []  # the step's saves, not started yet
        self._step_failed = False  # a layer-wise load of this step failed
        self._writes: list[Future] = []
        self._idle = False  # this step computes nothing (vLLM's no-forward step)

    # -- loads ------------------------------------------------------------------------------
    def start_load_kv(self, meta: TieredKVMetadata, idle: bool = False) -> None:
        """Start the step's loads; ``idle``: the step computes nothing (``IDLE_WAIT_S``)."""
        self._idle = idle
        loads = [ld for ld in meta.loads if ld.blocks]
        if self.load_async:
            for ld in loads:
                self._async[ld.req_id] = self.tiers.submit_load(ld.blocks, ld.digests)
            for ld in meta.loads:
                if not ld.blocks:  # nothing to copy: done now (vLLM waits for the id)
                    done: Future = Future()
                    done.set_result(set())
                    self._async[ld.req_id] = done
            return
        self._layer_events = [threading.Event() for _ in self._layer_of]
        if not loads:
            for e in self._layer_events:
                e.set()
            self._sync_load = None
            return
        # One chain per request: a request's failure must not cut another's pages, so each is
        # loaded on its own, in order, and a layer is announced once every load passed it.
        events, passes = self._layer_events, [0] * len(self._layer_of)
        lock = threading.Lock()

        def on_layer(layer: int) -> None:
            with lock:
                passes[layer] += 1
                if passes[layer] >= len(loads):
                    events[layer].set()

        def run() -> set[int]:
            failed: set[int] = set()
            for ld in loads:
                seen: set[int] = set()

                def once(layer: int, seen=seen) -> None:
                    if layer not in seen:
                        seen.add(layer)
                        on_layer(layer)

                failed |= self.tiers.load(ld.blocks, ld.digests, once)
            return failed

        self._sync_load = self.tiers.submit(run)

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_of.get(layer_name)
        if self.load_async or layer is None or not self._layer_events:
            return
        # Hazard: this layer's attention reads the loaded blocks; their bytes must be in place.
        self._layer_events[layer].wait(LAYER_WAIT_S)

    def finish_step_loads(self) -> None:
        """The step's layer-wise loads, waited for and their failures kept for vLLM. Where one
        failed, the forward that just ran read a block that was never filled, and every token
        it computed attended to it: the step's saves are dropped (vLLM recomputes from the
        failed block, and the recomputed blocks are saved then)."""
        self._step_failed = False
        if self._sync_load is not None:
            failed = self._sync_load.result()
            self._errors |= failed
            self._step_failed = bool(failed)
            self._sync_load = None
        self._layer_events = []

    def get_finished(self) -> set[str]:
        """Requests whose async load is done (their failed blocks joined ``load_errors``). In a
        step with nothing to compute, first waits up to ``IDLE_WAIT_S`` for one in flight."""
        wait_if_idle(self._idle, self._async.values())
        done = {r for r, f in self._async.items() if f.done()}
        for req_id in done:
            self._errors |= self._async.pop(req_id).result()
        return done

    def load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    # -- saves ------------------------------------------------------------------------------
    def begin_saves(self, meta: TieredKVMetadata) -> None:
        """Note the step's saves; their host slots are taken at the first layer saved, after the
        step's layer-wise loads took theirs (a load that finds no slot costs a hit now, a save
        that finds none only a future one)."""
        self._pending = [
            (b, d) for s in meta.saves for b, d in zip(s.blocks, s.digests, strict=True)
        ]
        self._saves = []

    def _started_saves(self) -> list[SaveCopy]:
        if self._pending:
            blocks, digests = (list(x) for x in zip(*self._pending, strict=True))
            self._saves = [self.tiers.begin_save(blocks, digests)]
            self._pending = []
        return self._saves

    def save_kv_layer(self, layer_name: str) -> None:
        layer = self._layer_of.get(layer_name)
        if layer is None:
            return
        for save in self._started_saves():
            self.tiers.copy_layer(save, layer)

    def wait_for_save(self) -> None:
        """The step's end: its layer-wise loads waited for (``finish_step_loads``), then its saves
        named and handed to the store, or dropped where a load of the step failed."""
        self.finish_step_loads()
        for save in self._started_saves():
            if self._step_failed:
                self.tiers.drop_save(save)
                continue
            future = self.tiers.finish_save(save)
            if future is not None:
                self._writes.append(future)
        self._saves = []
        self._writes = [f for f in self._writes if not f.done()]

    def shutdown(self) -> None:
        for f in list(self._async.values()) + self._writes:
            f.result()
        self.tiers.close()
