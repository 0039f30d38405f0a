"""The hybrid worker half (``HybridWorkerSide``) over real per-group tiers: each group's pages
are saved from its own layers and loaded back byte-exact into other blocks; a request fails as
a whole when any group's part fails or the scheduler doomed it; recurrent state is copied
after the forward of the step that offers it (the forward that computes it)."""

from __future__ import annotations

import dataclasses
import random

import torch

from tiered_kv.integrations.vllm.block_layout import describe_layers
from tiered_kv.integrations.vllm.metadata import BlockPages, TieredKVMetadata
from tiered_kv.integrations.vllm.settings import read_settings
from tiered_kv.integrations.vllm.tiers import ConnectorTiers
from tiered_kv.integrations.vllm.worker_hybrid import HybridWorkerSide

from ._kv import fill_bits_, make_caches, page_bytes, refill_
from .test_vllm_tiers import Faults

NB, H, BS, D = 10, 2, 4, 6
KIND = "LBHNC"
GROUP_LAYERS = {0: [0, 2], 1: [1, 3], 2: [4]}  # window, full, "state" (a raw page per block)
KINDS = {0: "vllm-window", 1: "vllm-attention", 2: "vllm-state"}


class Rig:
    def __init__(self, tmp_path, gen) -> None:
        settings = read_settings(
            {
                "model_id": "org/hybrid@rev1",
                "storage_path": str(tmp_path / "store"),
                "storage_bytes": 64 << 20,
            }
        )
        self.physical, tiers = {}, {}
        for g, layers in GROUP_LAYERS.items():
            caches, phys = make_caches(KIND, layers, NB, H, BS, D, gen)
            layout = dataclasses.replace(describe_layers(caches, NB), kind=KINDS[g])
            self.physical[g] = phys
            tiers[g] = ConnectorTiers(settings, layout, rank=None, num_slots=6)
        self.worker = HybridWorkerSide(tiers)
        self.gen = gen

    def page(self, g: int, block: int) -> torch.Tensor:
        return page_bytes(KIND, self.physical[g], block)

    def forward(self, meta: TieredKVMetadata) -> None:
        self.worker.begin_saves(meta)
        for t in self.worker.tiers.values():
            for name in t.layout.layer_names:
                self.worker.save_kv_layer(name)
        self.worker.wait_for_save()
        self.worker.start_load_kv(meta)

    def settle(self) -> tuple[set[str], set[str]]:
        for t in self.worker.tiers.values():
            t.drain()
        return self.worker.transfer_results()


def digest(i: int) -> bytes:
    return bytes([i]) * 32


def test_every_groups_pages_round_trip_byte_exact(tmp_path, gen):
    rig = Rig(tmp_path, gen)
    try:
        saves = [
            BlockPages("a", [1, 2], [digest(1), digest(2)], 0),
            BlockPages("a", [3, 4, 5], [digest(1), digest(2), digest(3)], 1),
        ]
        rig.forward(TieredKVMetadata(saves=saves))
        rig.settle()
        want = {(0, d): rig.page(0, b) for b, d in ((1, 1), (2, 2))} | {
            (1, d): rig.page(1, b) for b, d in ((3, 1), (4, 2), (5, 3))
        }
        for g in (0, 1):
            refill_(rig.physical[g], gen)
        loads = [
            BlockPages("b", [7, 8], [digest(1), digest(2)], 0),
            BlockPages("b", [6, 7, 9], [digest(1), digest(2), digest(3)], 1),
        ]
        rig.forward(TieredKVMetadata(loads=loads))
        assert rig.settle() == ({"b"}, set())
        for b, d in ((7, 1), (8, 2)):
            assert torch.equal(rig.page(0, b), want[(0, d)])
        for b, d in ((6, 1), (7, 2), (9, 3)):
            assert torch.equal(rig.page(1, b), want[(1, d)])
    finally:
        rig.worker.shutdown()


def test_a_request_fails_whole_when_one_group_fails_or_it_is_doomed(tmp_path, gen):
    rig = Rig(tmp_path, gen)
    try:
        rig.forward(TieredKVMetadata(saves=[BlockPages("a", [1], [digest(1)], 1)]))
        rig.settle()
        loads = [
            BlockPages("b", [2], [digest(1)], 1),  # present
            BlockPages("b", [3], [digest(1)], 0),  # the window group never saved it
            BlockPages("c", [4], [digest(1)], 1),
            BlockPages("d", [5], [digest(1)], 7),  # a group this rank holds no layers of
        ]
        rig.forward(TieredKVMetadata(loads=loads, doomed=["e"]))
        finished, failed = rig.settle()
        assert finished == {"b", "c", "d", "e"} and failed == {"b", "e"}
        assert rig.worker.transfer_results() == (set(), set())  # each reported once
    finally:
        rig.worker.shutdown()


def test_state_is_copied_after_the_forward_that_computes_it(tmp_path, gen):
    """vLLM offers a boundary's state in the step whose forward computes it: what is stored is
    the block after that forward, never what it held before."""
    rig = Rig(tmp_path, gen)
    try:
        meta = TieredKVMetadata(state_saves=[BlockPages("q", [3], [digest(9)], 2)])
        rig.worker.begin_saves(meta)
        for p in rig.physical[2].values():  # the step's forward writes the state
            fill_bits_(p, gen)
        after = rig.page(2, 3).clone()
        rig.worker.wait_for_save()
        rig.settle()
        rig.forward(TieredKVMetadata(loads=[BlockPages("r", [6], [digest(9)], 2)]))
        assert rig.settle() == ({"r"}, set())
        assert torch.equal(rig.page(2, 6), after)
        assert rig.worker.tiers[2].counters.snapshot()["saved_state_blocks"] == 1
        assert rig.worker.tiers[2].counters.snapshot()["loaded_state_blocks"] == 1
    finally:
        rig.worker.shutdown()


def test_random_faults_never_finish_a_request_with_wrong_bytes(tmp_path, gen):
    """Faults at random in every group's store and copies (``Faults``: failed reads and writes,
    damaged values, copies failing before or after they ran): a request reported finished and
    not failed holds, in every group, exactly the pages saved; no pin leaks."""
    rng = random.Random(int(torch.randint(1 << 30, (1,), generator=gen)))
    rig = Rig(tmp_path, gen)
    faults = [Faults(t, rng, gen) for t in rig.worker.tiers.values()]
    truth: dict[tuple[int, bytes], torch.Tensor] = {}
    served = failed_total = 0
    try:
        for step in range(150):
            if rng.random() < 0.5:  # a step saving 1-3 pages in each group
                saves, state = [], []
                for g in GROUP_LAYERS:
                    refill_(rig.physical[g], gen)
                    blocks = rng.sample(range(1, NB), rng.randint(1, 3))
                    digests = [digest(rng.randrange(40)) for _ in blocks]
                    if len(set(digests)) != len(digests) or any((g, d) in truth for d in digests):
                        continue
                    for b, d in zip(blocks, digests, strict=True):
                        truth[(g, d)] = rig.page(g, b)
                    part = BlockPages(f"s{step}", blocks, digests, g)
                    (state if g == 2 else saves).append(part)
                rig.forward(TieredKVMetadata(saves=saves, state_saves=state))
            else:  # a request loading a page of each group
                loads = []
                for g in GROUP_LAYERS:
                    known = [d for (gg, d) in truth if gg == g]
                    d = rng.choice(known) if known and rng.random() < 0.9 else digest(200)
                    loads.append(BlockPages(f"r{step}", [rng.randrange(1, NB)], [d], g))
                for g in GROUP_LAYERS:
                    refill_(rig.physical[g], gen)
                rig.forward(TieredKVMetadata(loads=loads))
                finished, failed = rig.settle()
                assert finished == {f"r{step}"}
                if failed:
                    failed_total += 1
                    continue
                served += 1
                for ld in loads:
                    got = rig.page(ld.group, ld.blocks[0])
                    assert torch.equal(got, truth[(ld.group, ld.digests[0])]), f"step {step}"
        for t in rig.worker.tiers.values():
            t.drain()
            assert t.slots.counts()["pinned"] == 0
        assert served > 0 and failed_total > 0
    finally:
        for f in faults:
            f.on = False
        rig.worker.shutdown()


def test_an_idle_step_waits_for_a_load_in_flight_and_a_forward_step_does_not(
    tmp_path, gen, monkeypatch
):
    """In a step with nothing to compute ``transfer_results`` waits (up to ``IDLE_WAIT_S``, long
    here) for a load in flight, so the request is reported without another step."""
    import threading
    import time

    from tiered_kv.integrations.vllm import worker_side

    rig = Rig(tmp_path, gen)
    try:
        rig.forward(TieredKVMetadata(saves=[BlockPages("a", [1], [digest(1)], 1)]))
        rig.settle()
        monkeypatch.setattr(worker_side, "IDLE_WAIT_S", 30.0)
        for idle, req in ((False, "b"), (True, "c")):
            gate = threading.Event()
            rig.worker.tiers[1].submit(lambda gate=gate: gate.wait(30) and set())
            rig.worker.start_load_kv(
                TieredKVMetadata(loads=[BlockPages(req, [2], [digest(1)], 1)]), idle=idle
            )
            if idle:
                threading.Timer(0.05, gate.set).start()
                assert rig.worker.transfer_results() == ({req}, set())
            else:
                t = time.monotonic()
                assert rig.worker.transfer_results() == (set(), set())  # no wait
                assert time.monotonic() - t < 5.0
                gate.set()
                assert rig.settle() == ({req}, set())
    finally:
        rig.worker.shutdown()
