"""Issue 14 (HiSparse): HiSparseSwapper keeps every token's latent and indexer key on the host
and swaps only the selected tokens into a request's fixed device buffer, per layer.

Random bits everywhere (NaN payloads included, so bytes are compared as uint8), irregular sizes
and page sizes 1 and 4. After every step of a random decode loop, in every layer, each buffer
slot marked as holding a token holds exactly that token's bytes (the oracle is a copy of what
was written, kept outside the pools); the slots returned for the selected positions hold their
bytes; hits + loaded count every selected token. A host -> device copy that fails at random
(raising after writing garbage, or refused before copying) leaves those tokens non-resident,
never marked resident over wrong bytes. Bad input raises the typed errors and changes nothing.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tiered_kv.device.allocator.hisparse import HiSparseTokenToKVPoolAllocator
from tiered_kv.device.dsa_pool import DSATokenToKVPool
from tiered_kv.device.hisparse_index import HiSparseIndexKeys
from tiered_kv.errors import InvalidArgumentError, StateError, TransferError
from tiered_kv.host.hisparse_swap import HiSparseSwapper
from tiered_kv.host.pool_group import HostPoolGroup
from tiered_kv.kernels import native_available, native_build
from tiered_kv.names import HostLayout
from tiered_kv.storage import MemoryStorage, StorageNamespace, page_keys
from tiered_kv.transfer import HostStorageTransfer, TransferJob

LAYERS, RANK, ROPE = 3, 13, 6
NATIVE = pytest.mark.skipif(not native_available(), reason="native copier not built")
COPY_MODES = [pytest.param("blocks", marks=NATIVE), "numpy", "kernel"]
PLAN_NATIVE = pytest.mark.skipif(
    native_build.load_swap_plan() is None, reason="native swap-in bookkeeping not built"
)
PLAN_MODES = [pytest.param("native", marks=PLAN_NATIVE), "numpy"]


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


class Rig:
    """A DSA pool behind a HiSparse allocator, its host group, and the bytes written."""

    def __init__(
        self,
        page: int,
        device_pages: int,
        gen: torch.Generator,
        layout: str = "layer_first",
        copy_mode: str = "auto",
        plan_mode: str = "auto",
    ) -> None:
        self.page, self.gen, self.copy_mode, self.plan_mode = page, gen, copy_mode, plan_mode
        size = device_pages * page
        self.pool = DSATokenToKVPool(size, page, torch.bfloat16, RANK, ROPE, LAYERS)
        self.alloc = HiSparseTokenToKVPoolAllocator(
            size, page, torch.bfloat16, "cpu", self.pool, host_to_device_ratio=8,
            kernel_backend="torch",
        )  # fmt: skip
        self.host = HostPoolGroup(
            self.pool.host_pool_decls(), self.alloc, size_tokens=8 * size, reserve_bytes=0,
            kernel_backend="torch", layout=layout,
        )  # fmt: skip
        self.keys = HiSparseIndexKeys(self.alloc, self.pool)
        self.latent: list[list[torch.Tensor]] = [[] for _ in range(LAYERS)]  # by position
        self.index: list[list[torch.Tensor]] = [[] for _ in range(LAYERS)]

    def write(self, dev: torch.Tensor) -> None:
        """Random bits into every layer's latent and indexer rows of device slots ``dev``."""
        for layer in range(LAYERS):
            lat = self.pool.kv_buffer[layer].view(torch.uint8)
            idx = self.pool.index_k_with_scale_buffer[layer]
            lat[dev] = torch.randint(0, 256, lat[dev].shape, dtype=torch.uint8, generator=self.gen)
            idx[dev] = torch.randint(0, 256, idx[dev].shape, dtype=torch.uint8, generator=self.gen)
            self.latent[layer] += list(lat[dev].reshape(dev.numel(), -1).clone())
            self.index[layer] += list(idx[dev].clone())

    def prefill(self, n: int, buffer_size: int, host_tokens: int):
        z = _t([0])
        logical = self.alloc.alloc_extend(z, z.clone(), _t([n]), _t([n]), _t([-1]), n)
        self.write(self.alloc.translate_loc(logical))
        host = self.host.alloc(-(-host_tokens // self.page) * self.page)
        sw = HiSparseSwapper.admit(
            self.alloc, self.pool, self.host, self.keys, logical, host[:n], buffer_size,
            copy_mode=self.copy_mode, plan_mode=self.plan_mode,
        )  # fmt: skip
        return sw, host

    def decode(self, sw: HiSparseSwapper, host: torch.Tensor) -> None:
        n = sw.num_tokens
        seq = _t([n + 1])
        tok = self.alloc.alloc_decode(seq, seq.clone(), sw.logical[-1:])
        slot = sw.begin_token(tok, host[n : n + 1])
        self.write(slot)
        sw.commit_token()

    def latent_bytes(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return self.pool.kv_buffer[layer].view(torch.uint8)[slots].reshape(slots.numel(), -1)

    def check_resident(self, sw: HiSparseSwapper) -> None:
        """Every slot marked as holding a token holds that token's bytes, in every layer."""
        for layer in range(LAYERS):
            for j, pos in enumerate(sw.resident(layer).tolist()):
                if pos >= 0:
                    got = self.latent_bytes(layer, sw.buffer[j : j + 1])[0]
                    assert torch.equal(got, self.latent[layer][pos]), (layer, j, pos)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.mark.parametrize("page", [1, 4])
def test_host_holds_every_part_and_scoring_reads_every_key(gen, page):
    rig = Rig(page, device_pages=40 // page + 3, gen=gen)
    sw, host = rig.prefill(37, buffer_size=12, host_tokens=50)
    for _ in range(5):
        rig.decode(sw, host)
    n = sw.num_tokens
    assert n == 42
    kv, indexer = rig.host.members
    for layer in range(LAYERS):
        h_lat = kv.part_view("kv")[layer].reshape(kv.size, -1).view(torch.uint8)[host[:n]]
        h_idx = indexer.part_view("index_k_with_scale")[layer][host[:n]]
        assert torch.equal(h_lat, torch.stack(rig.latent[layer]))
        assert torch.equal(h_idx, torch.stack(rig.index[layer]))
        rows = rig.keys.get_rows(layer, sw.logical)
        assert torch.equal(rows, torch.stack(rig.index[layer]))
    # the prefill's device slots became the buffer: the first 12 tokens stay resident
    assert sw.resident(0).tolist() == list(range(12))
    rig.check_resident(sw)
    sw.release()


@pytest.mark.parametrize("page", [1, 4])
def test_random_decode_loop_swaps_exactly_the_selected_tokens(gen, page):
    rng = random.Random(page)
    buffer_size = 16 if page == 4 else 11
    rig = Rig(page, device_pages=60 // page + 4, gen=gen)
    sw, host = rig.prefill(53, buffer_size=buffer_size, host_tokens=120)
    total_hits = total_loaded = 0
    for _ in range(40):
        rig.decode(sw, host)
        n = sw.num_tokens
        for layer in range(LAYERS):
            # a drifting top-k: mostly recent tokens, some far ones, each layer its own
            k = rng.randint(0, buffer_size)
            pool_ = list(range(max(0, n - 2 * buffer_size), n)) + rng.sample(range(n), 4)
            sel = _t(rng.sample(sorted(set(pool_)), min(k, len(set(pool_)))))
            before = sw.resident(layer)
            got = sw.swap_in(layer, sel)
            was = set(before.tolist())
            assert got.hits == sum(int(p) in was for p in sel.tolist())
            assert got.hits + got.loaded == sel.numel() and got.failed.numel() == 0
            total_hits += got.hits
            total_loaded += got.loaded
            if sel.numel():
                want = torch.stack([rig.latent[layer][p] for p in sel.tolist()])
                assert torch.equal(rig.latent_bytes(layer, got.device_slots), want)
            assert set(sel.tolist()) <= set(sw.resident(layer).tolist())
            assert len(set(got.device_slots.tolist())) == sel.numel()
        rig.check_resident(sw)
    assert total_hits and total_loaded
    assert (sw.num_hits, sw.num_loaded) == (total_hits, total_loaded)
    free = rig.alloc.device_available_size()
    sw.release()
    assert rig.alloc.device_available_size() == free + buffer_size + page
    assert int((rig.alloc.logical_to_device[:-1] != 0).sum()) == 0


def test_the_newest_token_is_a_hit_at_the_reserved_slot(gen):
    rig = Rig(1, device_pages=30, gen=gen)
    sw, host = rig.prefill(20, buffer_size=5, host_tokens=30)
    n = sw.num_tokens
    tok = rig.alloc.alloc_decode(_t([n + 1]), _t([n + 1]), sw.logical[-1:])
    slot = sw.begin_token(tok, host[n : n + 1])
    rig.write(slot)
    got = sw.swap_in(1, _t([n, 0, 19, 7, 8, 9]))  # the newest and five more: a full buffer
    assert got.device_slots[0] == slot[0] and got.hits == 1 + 1  # token 0 was kept resident
    assert got.loaded == 4
    keys = sw.score_keys(2)
    assert keys.shape == (n + 1, 128)
    sw.commit_token()
    assert torch.equal(keys.view(torch.uint8), sw.score_keys(2).view(torch.uint8))
    sw.release()


@pytest.mark.parametrize("copy_mode", COPY_MODES)
def test_failed_copies_leave_tokens_non_resident(gen, monkeypatch, copy_mode):
    rng = random.Random(7)
    rig = Rig(4, device_pages=30, gen=gen, copy_mode=copy_mode)
    sw, host = rig.prefill(61, buffer_size=12, host_tokens=110)
    real = sw._rows.load
    faults = {"raised": 0, "refused": 0}

    def flaky(layer_id, host_slots, dev_rows):
        roll = rng.random()
        if roll < 0.15:  # refused before any byte moves
            faults["refused"] += 1
            raise StateError("refused")
        real(layer_id, host_slots, dev_rows)
        if roll < 0.45:  # the copy dies part-way: some rows hold garbage
            bad = torch.from_numpy(dev_rows[: max(1, dev_rows.size // 2)])
            raw = rig.pool.kv_buffer[layer_id].view(torch.uint8)
            raw[bad] = torch.randint(0, 256, raw[bad].shape, dtype=torch.uint8)
            faults["raised"] += 1
            raise TransferError("copy failed part-way")

    monkeypatch.setattr(sw._rows, "load", flaky)
    failed = 0
    for _ in range(30):
        rig.decode(sw, host)
        n = sw.num_tokens
        for layer in range(LAYERS):
            sel = _t(rng.sample(range(n), rng.randint(1, 12)))
            got = sw.swap_in(layer, sel)
            res = set(sw.resident(layer).tolist())
            assert not set(got.failed.tolist()) & res  # a failed token is not resident
            bad = torch.isin(sel, got.failed)
            assert bool((got.device_slots[bad] == 0).all())
            if (~bad).any():
                want = torch.stack([rig.latent[layer][p] for p in sel[~bad].tolist()])
                assert torch.equal(rig.latent_bytes(layer, got.device_slots[~bad]), want)
            failed += got.failed.numel()
            rig.check_resident(sw)
    assert faults["raised"] and faults["refused"] and failed == sw.num_failed > 0
    assert isinstance(sw.last_error, (StateError, TransferError))
    monkeypatch.setattr(sw._rows, "load", real)
    n = sw.num_tokens
    got = sw.swap_in(0, _t(list(range(n - 12, n))))  # a retry after the faults: all land
    assert got.failed.numel() == 0
    rig.check_resident(sw)
    assert int((rig.alloc.logical_to_device[sw.logical] != 0).sum()) == 0  # no entries


def test_swap_in_neither_translates_nor_touches_the_table(gen, monkeypatch):
    """The buffer's slots are physical already: swap-in copies into them without the
    allocator's translation (refusing it changes nothing) and leaves the table as it was."""
    rig = Rig(1, device_pages=30, gen=gen)
    sw, _ = rig.prefill(25, buffer_size=6, host_tokens=25)

    def refuse(indices):
        raise StateError("refused")

    monkeypatch.setattr(rig.alloc, "translate_kv_indices_for_transfer", refuse)
    table = rig.alloc.logical_to_device.clone()
    got = sw.swap_in(0, _t([3, 20, 21]))
    assert got.hits == 1 and got.loaded == 2 and got.failed.numel() == 0
    want = torch.stack([rig.latent[0][p] for p in (3, 20, 21)])
    assert torch.equal(rig.latent_bytes(0, got.device_slots), want)
    assert torch.equal(table, rig.alloc.logical_to_device)
    rig.check_resident(sw)


class LRUModel:
    """Residency per layer in plain Python: the contract ``swap_in`` keeps (a hit keeps its
    slot; a miss takes the least recently used slot not selected, ties by slot; a failed copy
    leaves its slots empty and oldest)."""

    def __init__(self, layers: int, buffer_size: int, kept: int) -> None:
        self.held = [list(range(kept)) + [-1] * (buffer_size - kept) for _ in range(layers)]
        self.used = [[-1] * buffer_size for _ in range(layers)]
        self.clock = 0

    def swap(self, layer: int, sel: list[int], newest: int | None, ok: bool) -> tuple:
        held, used = self.held[layer], self.used[layer]
        rest = [p for p in sel if p != newest]
        slot = {p: j for j, p in enumerate(held) if p >= 0}
        miss = [p for p in rest if p not in slot]
        keep = {slot[p] for p in rest if p in slot}
        free = sorted((j for j in range(len(held)) if j not in keep), key=lambda j: used[j])
        victims = free[: len(miss)]
        for j in victims:
            slot.pop(held[j], None)
            held[j] = -1
        for p, j in zip(miss, victims, strict=True):
            if ok:
                held[j], slot[p] = p, j
            else:
                used[j] = -1
        self.clock += 1
        for p in rest:
            if p in slot:
                used[slot[p]] = self.clock
        hits = len(rest) - len(miss) + (newest in sel)
        return hits, len(miss) if ok else 0, 0 if ok else len(miss)


@pytest.mark.parametrize("plan_mode", PLAN_MODES)
@pytest.mark.parametrize("copy_mode", COPY_MODES)
@pytest.mark.parametrize("page", [1, 4])
def test_residency_follows_the_lru_model_with_faults(gen, monkeypatch, copy_mode, page, plan_mode):
    rng = random.Random(100 * page + len(copy_mode))
    buffer_size = 16 if page == 4 else 13
    rig = Rig(page, device_pages=200 // page + 6, gen=gen, copy_mode=copy_mode, plan_mode=plan_mode)
    sw, host = rig.prefill(21, buffer_size=buffer_size, host_tokens=180)
    model = LRUModel(LAYERS, buffer_size, min(buffer_size, 21))
    real = sw._rows.load
    fail = [False]

    def maybe(layer_id, host_slots, dev_rows):
        if fail[0]:
            raise TransferError("injected")
        real(layer_id, host_slots, dev_rows)

    monkeypatch.setattr(sw._rows, "load", maybe)
    for step in range(60):
        if step % 3 == 0:
            rig.decode(sw, host)
        n = sw.num_tokens
        newest = None
        if step % 3 == 1:  # a token begun, not yet committed: a hit at the reserved slot
            tok = rig.alloc.alloc_decode(_t([n + 1]), _t([n + 1]), sw.logical[-1:])
            rig.write(sw.begin_token(tok, host[n : n + 1]))
            newest, n = n, n + 1
        for layer in range(LAYERS):
            k = rng.randint(0, buffer_size + (newest is not None))
            sel = rng.sample(range(n), k)
            if newest is not None and newest not in sel and len(sel) > buffer_size:
                sel = sel[:buffer_size]
            fail[0] = rng.random() < 0.2
            before = set(sw.resident(layer).tolist())
            got = sw.swap_in(layer, _t(sel))
            # copied: the indices into sel of exactly the tokens copied in now (none on failure)
            want_copied = (
                [] if fail[0] else [i for i, p in enumerate(sel) if p not in before and p != newest]
            )
            assert got.copied.tolist() == want_copied
            assert (got.hits, got.loaded, got.failed.numel()) == model.swap(
                layer, sel, newest, not fail[0]
            )
            assert sw.resident(layer).tolist() == model.held[layer]
            _map_matches_residency(sw)
            ok = ~torch.isin(_t(sel), got.failed)
            if ok.any():
                want = torch.stack([rig.latent[layer][p] for p in _t(sel)[ok].tolist()])
                assert torch.equal(rig.latent_bytes(layer, got.device_slots[ok]), want)
        rig.check_resident(sw)
        if newest is not None:
            sw.commit_token()
    assert sw.num_failed and sw.num_loaded and sw.num_hits
    assert sw.num_tokens > 2 * 21 and sw._slot_of.shape[1] >= sw.num_tokens  # the map grew
    _map_matches_residency(sw)


@pytest.mark.parametrize("plan_mode", PLAN_MODES)
def test_strided_and_int32_selections_read_as_their_values(gen, plan_mode):
    rig = Rig(4, device_pages=20, gen=gen, plan_mode=plan_mode)
    sw, _ = rig.prefill(30, buffer_size=8, host_tokens=40)
    wide = torch.tensor([[3, 99], [17, 99], [29, 99], [8, 99]])  # column 0: a strided view
    for sel in (wide[:, 0], wide[:, 0].to(torch.int32), _t([29, 8, 3, 17])[1::1]):
        got = sw.swap_in(1, sel)
        want = torch.stack([rig.latent[1][p] for p in sel.tolist()])
        assert torch.equal(rig.latent_bytes(1, got.device_slots), want)
    assert sw.num_loaded == 3 and sw.num_hits == 8  # 3 was kept from the prefill


def _map_matches_residency(sw: HiSparseSwapper) -> None:
    """The swapper's position -> buffer index map says exactly what ``token_in`` holds (and
    the newest token, while pending, is at the reserved index in every layer)."""
    for layer in range(sw.pool.layer_num):
        held = sw.token_in[layer].tolist()
        want = {p: j for j, p in enumerate(held) if p >= 0}
        if sw.newest is not None:
            want[sw.newest] = sw.buffer_size
        row = sw._slot_of[layer]
        got = {int(p): int(row[p]) for p in np.flatnonzero(row >= 0)}
        assert got == want, layer


def _state(rig: Rig, sw: HiSparseSwapper):
    return (
        sw.token_in.clone(), sw.last_used.clone(), rig.alloc.logical_to_device.clone(),
        torch.from_numpy(sw._slot_of.copy()),
        [b.view(torch.uint8).clone() for b in rig.pool.buffers()],
        (sw.num_hits, sw.num_loaded, sw.num_failed, sw.clock, sw.newest, sw.num_tokens),
        rig.alloc.device_available_size(),
    )  # fmt: skip


def _same(a, b) -> bool:
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif isinstance(x, list):
            if not all(torch.equal(p, q) for p, q in zip(x, y, strict=True)):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("plan_mode", PLAN_MODES)
def test_bad_input_raises_and_changes_nothing(gen, plan_mode):
    rig = Rig(4, device_pages=20, gen=gen, plan_mode=plan_mode)
    sw, host = rig.prefill(30, buffer_size=8, host_tokens=40)
    sw.swap_in(0, _t([1, 25, 29]))
    before = _state(rig, sw)
    bad_calls = [
        (InvalidArgumentError, lambda: sw.swap_in(0, _t([30]))),  # past the last token
        (InvalidArgumentError, lambda: sw.swap_in(0, _t([-1]))),
        (InvalidArgumentError, lambda: sw.swap_in(0, _t([3, 3]))),  # repeated
        (InvalidArgumentError, lambda: sw.swap_in(0, _t([1, 25, 29, 25]))),  # a hit twice
        (InvalidArgumentError, lambda: sw.swap_in(0, _t([29, 3, 7, 1, 3]))),  # a miss twice
        (InvalidArgumentError, lambda: sw.swap_in(0, _t([1, 3, 25, 2, 7, 29, 30]))),  # range
        (InvalidArgumentError, lambda: sw.swap_in(0, _t([*range(9), 31]))),  # > buffer, range
        (InvalidArgumentError, lambda: sw.swap_in(0, _t(list(range(9))))),  # > buffer
        (InvalidArgumentError, lambda: sw.swap_in(0, _t([2] * 10))),  # repeated, > buffer
        (InvalidArgumentError, lambda: sw.swap_in(0, _t([4, 5, 4]).to(torch.int32))),
        (InvalidArgumentError, lambda: sw.swap_in(0, torch.tensor([1.0, 2.0]))),
        (InvalidArgumentError, lambda: sw.swap_in(0, _t([[1, 2]]))),
        (InvalidArgumentError, lambda: sw.swap_in(LAYERS, _t([1]))),  # no such layer
        (InvalidArgumentError, lambda: sw.swap_in(True, _t([1]))),
        (InvalidArgumentError, lambda: sw.begin_token(_t([5, 6]), _t([30, 31]))),
        (InvalidArgumentError, lambda: sw.begin_token(sw.logical[:1], host[30:31])),  # old token
        (StateError, lambda: sw.commit_token()),  # nothing begun
    ]
    for err, call in bad_calls:
        with pytest.raises(err):
            call()
        assert _same(before, _state(rig, sw))
        _map_matches_residency(sw)  # the position -> slot map as it was
    sw.release()
    with pytest.raises(StateError, match="released"):
        sw.swap_in(0, _t([1]))


def test_admit_checks_and_refuses_cleanly(gen):
    rig = Rig(4, device_pages=12, gen=gen)
    z = _t([0])
    logical = rig.alloc.alloc_extend(z, z.clone(), _t([30]), _t([30]), _t([-1]), 30)
    host = rig.host.alloc(32)
    args = (rig.alloc, rig.pool, rig.host, rig.keys)
    with pytest.raises(InvalidArgumentError, match="multiple of page_size"):
        HiSparseSwapper.admit(*args, logical, host[:30], 6)
    with pytest.raises(InvalidArgumentError, match="pair|one of each"):
        HiSparseSwapper.admit(*args, logical, host[:29], 8)
    table = rig.alloc.logical_to_device.clone()
    free = rig.alloc.device_available_size()
    # more than the device holds: None, the prefill's device slots untouched
    assert HiSparseSwapper.admit(*args, logical, host[:30], 12 * 4) is None
    assert torch.equal(table, rig.alloc.logical_to_device)
    assert rig.alloc.device_available_size() == free
    sw = HiSparseSwapper.admit(*args, logical, host[:30], 8)
    assert sw is not None and rig.alloc.device_available_size() == 12 * 4 - 12
    with pytest.raises(StateError, match="no device slot"):  # its tokens gave theirs back
        HiSparseSwapper.admit(*args, logical, host[:30], 8)


@pytest.mark.parametrize("layout", HostLayout.values())
def test_every_part_round_trips_through_storage_for_every_layout(gen, layout, tmp_path):
    """The host copy of a HiSparse request (latent and indexer rows of every token) goes to
    storage and back, and tokens swapped in from it have exactly the bytes written."""
    page = 4
    rig = Rig(page, device_pages=60 // page + 4, gen=gen, layout=layout)
    sw, host = rig.prefill(37, buffer_size=12, host_tokens=40)
    ns = StorageNamespace.for_host_pool(rig.host, model="hisparse-test@1")
    store = MemoryStorage(ns, rig.host.page_nbytes)
    worker = HostStorageTransfer(rig.host, store, batch_pages=3)
    try:
        pages = host[:36:page]  # the 9 whole pages of the prompt
        keys = page_keys(ns, torch.randint(0, 9999, (36,), generator=gen), page)
        idx = host[:36]
        assert worker.submit(TransferJob.backup(1, keys, idx))
        worker.wait([1])
        assert worker.poll()[0].pages_done == len(pages)
        host_pages = sorted({int(h) // page for h in idx.tolist()})
        before = [[m.get_page_bytes(p).clone() for p in host_pages] for m in rig.host.members]
        for m in rig.host.members:  # host copy gone: only storage holds these bytes now
            m.buffer.view(torch.uint8).fill_(0xA5)
        assert worker.submit(TransferJob.prefetch(2, keys, idx))
        worker.wait([2])
        assert worker.poll()[0].pages_done == len(pages)
        for m, pages_before in zip(rig.host.members, before, strict=True):  # every part
            for p, b in zip(host_pages, pages_before, strict=True):
                assert torch.equal(m.get_page_bytes(p), b), (m.decl.name, p)
        for layer in range(LAYERS):
            sel = _t(random.Random(layer).sample(range(36), 12))
            got = sw.swap_in(layer, sel)
            assert got.failed.numel() == 0
            want = torch.stack([rig.latent[layer][p] for p in sel.tolist()])
            assert torch.equal(rig.latent_bytes(layer, got.device_slots), want), layer
        rig.check_resident(sw)
    finally:
        worker.close()
