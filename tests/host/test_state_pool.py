"""HostStatePool: snapshots of per-request state round-trip bit-exactly device -> host -> device
in every layout and through both disk layouts, bad calls are refused with typed errors and change
nothing, and the storage namespace and keys of state never meet those of other geometries.

Declarations come from a fake owner's plain tensors (irregular shapes; bfloat16, float32,
float16, int32 and a 0-d part), filled with random bits; bytes are compared as uint8, never as
floats (random bits include NaNs)."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.device.state_decl import StatePart, StatePoolDecl
from tiered_kv.errors import (
    BackendUnavailableError,
    HostMemoryError,
    InvalidArgumentError,
    OwnershipError,
    StateError,
)
from tiered_kv.host.state_pool import HostStatePool
from tiered_kv.names import HostLayout, StorageLayout
from tiered_kv.platform import cuda_available
from tiered_kv.storage.keys import page_digests, page_keys_of, state_keys_of
from tiered_kv.storage.layouts import open_store

LAYOUTS = HostLayout.values()
BUDGET = 64 << 20
SPEC = {  # decl name -> (kind, rows, parts)
    "mamba": (
        "mamba",
        9,
        [
            ("conv", (3, 5), torch.bfloat16),
            ("ssm", (2, 40, 13), torch.float32),  # one slot spans more than a 4 KiB block
            ("step", (), torch.int32),
        ],
    ),
    "ngram": ("ngram", 11, [("tokens", (7,), torch.int32), ("weights", (1, 3), torch.float16)]),
}
DEVICE_ROWS = 9  # rows every declaration has
NUM_SLOTS = 7


class Owner:
    """A device owner of state: one plain tensor per part, handed out through buffer()."""

    def __init__(self, spec: dict, gen: torch.Generator) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.decls = []
        for name, (kind, rows, parts) in spec.items():
            made = []
            for part, shape, dtype in parts:
                key = f"{name}.{part}"
                self.tensors[key] = torch.empty((rows, *shape), dtype=dtype)

                def buffer(key=key) -> torch.Tensor:
                    return self.tensors[key]

                made.append(StatePart(part, shape, dtype, buffer))
            self.decls.append(StatePoolDecl(name, kind, self, tuple(made), rows))
        self.scribble(gen)

    def scribble(self, gen: torch.Generator) -> None:
        for t in self.tensors.values():
            t.reshape(-1).view(torch.uint8).random_(0, 256, generator=gen)

    def rows(self) -> dict[str, torch.Tensor]:
        """Per part, a uint8 copy ``(rows, part_nbytes)`` of the whole buffer."""
        return {k: _bytes(t).clone() for k, t in self.tensors.items()}

    def slot_bytes(self, slot: int) -> torch.Tensor:
        """Device slot ``slot``'s bytes, every part in declaration order (the stored format)."""
        return torch.cat([_bytes(t)[slot] for t in self.tensors.values()])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def _pool(owner: Owner, layout: str, num_slots: int = NUM_SLOTS, **kw) -> HostStatePool:
    kw.setdefault("reserve_bytes", 0)
    return HostStatePool(owner.decls, num_slots, layout=layout, **kw)


def _ids(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _distinct(gen: torch.Generator, n: int, low: int, high: int) -> torch.Tensor:
    return torch.randperm(high - low, generator=gen)[:n] + low


def _host_state(pool: HostStatePool) -> torch.Tensor:
    return torch.stack([pool.get_page_bytes(s).clone() for s in range(pool.num_slots)])


def _assert_loaded(owner, before, after_scribble, src, dst) -> None:
    """Device rows ``dst`` hold ``before``'s rows ``src``; every other row is unchanged."""
    now = owner.rows()
    for key, rows in now.items():
        want = after_scribble[key].clone()
        want[dst] = before[key][src]
        assert torch.equal(rows, want), key


@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_host_device_is_bit_exact(gen, layout):
    owner = Owner(SPEC, gen)
    pool = _pool(owner, layout)
    assert pool.slot_nbytes == sum(r.shape[1] for r in owner.rows().values())
    assert pool.nbytes == NUM_SLOTS * pool.slot_nbytes
    slots = pool.alloc(NUM_SLOTS)
    host = slots[torch.randperm(NUM_SLOTS, generator=gen)[:5]]
    src = _distinct(gen, 5, 1, DEVICE_ROWS)
    before = owner.rows()
    pool.backup_from_device(src, host)
    for s, h in zip(src.tolist(), host.tolist(), strict=True):
        assert torch.equal(pool.get_page_bytes(h), owner.slot_bytes(s))
    owner.scribble(gen)
    after = owner.rows()
    dst = _distinct(gen, 5, 1, DEVICE_ROWS)
    pool.load_to_device(host, dst)
    _assert_loaded(owner, before, after, src, dst)
    # One snapshot restored into two device slots (two requests resuming from one prefix).
    now = owner.rows()
    pool.load_to_device(host[:1].repeat(2), _ids([1, 2]))
    _assert_loaded(owner, before, now, src[:1].repeat(2), _ids([1, 2]))
    pool.backup_from_device(_ids([]), _ids([]))  # empty is a no-op


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_non_contiguous_owner_buffer_round_trips_bit_exactly(gen, layout):
    # The copies go slot by slot; a strided owner row (a part sliced out of a wider tensor)
    # must come back byte for byte too.
    wide = torch.empty((DEVICE_ROWS, 4, 9), dtype=torch.float32)
    wide.view(torch.uint8).random_(0, 256, generator=gen)
    part = wide[:, :, 2:7]  # (rows, 4, 5), not contiguous
    assert not part[1].is_contiguous()
    decl = StatePoolDecl(
        "s", "mamba", None, (StatePart("p", (4, 5), torch.float32, lambda: part),), DEVICE_ROWS
    )
    pool = HostStatePool([decl], 3, layout=layout, reserve_bytes=0)
    host = pool.alloc(2)
    src = part[[3, 5]].clone()
    pool.backup_from_device(_ids([3, 5]), host)
    pool.load_to_device(host, _ids([1, 7]))
    assert torch.equal(part[[1, 7]].view(torch.uint8), src.view(torch.uint8))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_index_tensors_may_be_int32_and_the_stored_format_is_the_same_in_every_layout(gen, layout):
    owner = Owner(SPEC, gen)
    ref = _pool(owner, "page_first")
    pool = _pool(owner, layout)
    for p in (ref, pool):
        p.alloc(NUM_SLOTS)
        p.backup_from_device(torch.arange(1, 8, dtype=torch.int32), torch.arange(7).int())
    assert torch.equal(_host_state(pool), _host_state(ref))


@pytest.mark.parametrize("store_layout", StorageLayout.values())
@pytest.mark.parametrize("layout", LAYOUTS)
def test_through_storage_bytes_exact_corruption_a_miss(tmp_path, gen, layout, store_layout):
    owner = Owner(SPEC, gen)
    pool = _pool(owner, layout)
    host = pool.alloc(NUM_SLOTS)[torch.randperm(NUM_SLOTS, generator=gen)[:4]]
    src = _distinct(gen, 4, 1, DEVICE_ROWS)
    before = owner.rows()
    pool.backup_from_device(src, host)
    ns = pool.namespace(model="hybrid-test@1")
    digests = page_digests(torch.randint(0, 50000, (4 * 16,), generator=gen), 16)
    keys = state_keys_of(ns, digests)
    path = tmp_path / "s"
    store = open_store(store_layout, path, ns, pool.page_nbytes, budget_bytes=BUDGET)
    assert store.batch_set(keys, pool, host.tolist()) == [True] * 4
    store.close()

    fresh = _pool(owner, layout)
    slots = fresh.alloc(NUM_SLOTS)[torch.randperm(NUM_SLOTS, generator=gen)[:4]]
    store = open_store(store_layout, path, ns, fresh.page_nbytes, budget_bytes=BUDGET)
    try:
        assert store.batch_get(keys, fresh, slots.tolist()) == [True] * 4
    finally:
        store.close()
    owner.scribble(gen)
    after = owner.rows()
    dst = _distinct(gen, 4, 1, DEVICE_ROWS)
    fresh.load_to_device(slots, dst)
    _assert_loaded(owner, before, after, src, dst)

    # One stored value's bytes flipped on disk: a miss (and gone), the others still exact.
    _flip_stored_value(path, pool.get_page_bytes(int(host[1])))
    fresh.set_page_bytes(int(slots[0]), bytes(fresh.page_nbytes))
    store = open_store(store_layout, path, ns, fresh.page_nbytes, budget_bytes=BUDGET)
    try:
        assert store.batch_get(keys, fresh, slots.tolist()) == [True, False, True, True]
        assert store.stats().checksum_failures == 1
        assert store.batch_exists(keys[1:2]) == 0
    finally:
        store.close()
    for i in (0, 2, 3):
        assert torch.equal(fresh.get_page_bytes(int(slots[i])), pool.get_page_bytes(int(host[i])))


def _flip_stored_value(path, value: torch.Tensor) -> None:
    """Flip one byte in the middle of the one copy of ``value`` in the store's files."""
    needle = value.numpy().tobytes()
    found = []
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        data = bytearray(f.read_bytes())
        at = data.find(needle)
        if at >= 0:
            assert data.find(needle, at + 1) < 0
            found.append(f)
            data[at + len(needle) // 2] ^= 0x5A
            f.write_bytes(bytes(data))
    assert len(found) == 1, found


@pytest.mark.parametrize("store_layout", StorageLayout.values())
def test_a_key_of_another_namespace_is_never_served(tmp_path, gen, store_layout):
    owner = Owner(SPEC, gen)
    pool = _pool(owner, "page_first")
    pool.alloc(NUM_SLOTS)
    pool.backup_from_device(torch.arange(1, 5), torch.arange(4))
    ns = pool.namespace(model="hybrid-test@1")
    digests = page_digests(torch.randint(0, 50000, (4 * 8,), generator=gen), 8)
    path = tmp_path / "s"
    store = open_store(store_layout, path, ns, pool.page_nbytes, budget_bytes=BUDGET)
    assert store.batch_set(state_keys_of(ns, digests), pool, [0, 1, 2, 3]) == [True] * 4
    store.close()

    spec = dict(SPEC)
    kind, rows, parts = spec["ngram"]
    spec["ngram"] = (kind, rows, [*parts[:-1], ("weights", (1, 4), torch.float16)])
    other_geometry = _pool(Owner(spec, gen), "page_first")
    other_geometry.alloc(NUM_SLOTS)
    for other_pool, other_ns in (
        (pool, pool.namespace(model="hybrid-test@2")),
        (other_geometry, other_geometry.namespace(model="hybrid-test@1")),
    ):
        other = open_store(
            store_layout, path, other_ns, other_pool.page_nbytes, budget_bytes=BUDGET
        )
        try:
            keys = state_keys_of(other_ns, digests)
            snap = _host_state(other_pool)
            assert other.batch_exists(keys) == 0
            assert other.batch_get(keys, other_pool, [4, 5, 6, 0]) == [False] * 4
            assert torch.equal(_host_state(other_pool), snap)
            with pytest.raises(InvalidArgumentError, match="unknown namespace"):
                other.batch_get(state_keys_of(ns, digests), other_pool, [4, 5, 6, 0])
        finally:
            other.close()
    store = open_store(store_layout, path, ns, pool.page_nbytes, budget_bytes=BUDGET)
    try:  # the original values are still there for their own namespace
        assert store.batch_exists(state_keys_of(ns, digests)) == 4
    finally:
        store.close()


def test_state_keys_never_equal_page_keys():
    owner = Owner(SPEC, torch.Generator().manual_seed(0))
    ns = _pool(owner, "page_first", num_slots=1).namespace(model="m@1")
    digests = page_digests(list(range(64)), 16)
    state, page = state_keys_of(ns, digests), page_keys_of(ns, digests)
    assert all(
        k.startswith(ns.fingerprint) and len(k) == len(p) for k, p in zip(state, page, strict=True)
    )
    assert not set(state) & set(page)
    assert not set(state) & set(page_keys_of(ns, digests, windowless=True))
    assert len(set(state)) == 4 and state == state_keys_of(ns, digests)
    with pytest.raises(InvalidArgumentError, match="31 bytes"):
        state_keys_of(ns, [digests[0][:31]])


def test_namespace_covers_every_part_and_the_layout(gen):
    def ns(spec, layout="page_first", **kw):
        kw.setdefault("model", "m@1")
        return _pool(Owner(spec, gen), layout, num_slots=1).namespace(**kw).fingerprint

    def changed(decl, i, **what):
        kind, rows, parts = SPEC[decl]
        name, shape, dtype = parts[i]
        part = (what.get("name", name), what.get("shape", shape), what.get("dtype", dtype))
        return {**SPEC, decl: (kind, rows, [*parts[:i], part, *parts[i + 1 :]])}

    base = ns(SPEC)
    rows_only = {k: (kind, rows + 3, parts) for k, (kind, rows, parts) in SPEC.items()}
    assert ns(rows_only) == base  # the device's row count is not the geometry of a slot
    variants = [
        ns(changed("mamba", 0, shape=(5, 3))),
        ns(changed("mamba", 1, dtype=torch.int32)),
        ns(changed("mamba", 2, dtype=torch.float32)),
        ns(changed("ngram", 0, name="token")),
        ns({"mamba2" if k == "mamba" else k: v for k, v in SPEC.items()}),
        ns({"ngram": SPEC["ngram"], "mamba": SPEC["mamba"]}),  # declaration order
        ns(SPEC, "page_first_direct"),
        ns(SPEC, "layer_first"),
        ns(SPEC, model="m@2"),
        ns(SPEC, tenant="t"),
        ns(SPEC, rank="tp1"),
    ]
    assert len({base, *variants}) == len(variants) + 1


def _bad_calls(pool: HostStatePool, owner: Owner):
    """(call, error, message) of refused transfers; host slots 0..4 are allocated."""
    ok_h, ok_d = _ids([0, 1]), _ids([1, 2])
    b, ld = pool.backup_from_device, pool.load_to_device
    return [
        (lambda: b(ok_d, _ids([0])), InvalidArgumentError, "pair up"),
        (lambda: ld(_ids([0, 1, 2]), ok_d), InvalidArgumentError, "pair up"),
        (lambda: b(ok_d, _ids([0, NUM_SLOTS])), InvalidArgumentError, "outside the valid range"),
        (lambda: ld(_ids([-1, 0]), ok_d), InvalidArgumentError, "outside the valid range"),
        (lambda: b(_ids([1, DEVICE_ROWS]), ok_h), InvalidArgumentError, r"\[0, 9\)"),
        (lambda: ld(ok_h, _ids([DEVICE_ROWS, 1])), InvalidArgumentError, r"\[0, 9\)"),
        (lambda: b(_ids([0, 1]), ok_h), OwnershipError, "padding"),
        (lambda: ld(ok_h, _ids([2, 0])), OwnershipError, "padding"),
        (lambda: b(ok_d, _ids([3, 3])), InvalidArgumentError, "repeat"),
        (lambda: ld(ok_h, _ids([4, 4])), InvalidArgumentError, "repeat"),
        (lambda: b(ok_d, _ids([0, 5])), OwnershipError, "not allocated"),
        (lambda: ld(_ids([6, 1]), ok_d), OwnershipError, "not allocated"),
        (lambda: b(ok_d.float(), ok_h), InvalidArgumentError, "dtype"),
        (lambda: ld(ok_h.reshape(1, 2), ok_d), InvalidArgumentError, "1-D"),
        (lambda: b([1, 2], ok_h), InvalidArgumentError, "torch.Tensor"),
    ]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bad_transfers_raise_typed_errors_and_change_nothing(gen, layout):
    owner = Owner(SPEC, gen)
    pool = _pool(owner, layout)
    pool.alloc(5)
    pool.backup_from_device(torch.arange(1, 6), torch.arange(5))
    for call, error, match in _bad_calls(pool, owner):
        host, dev = _host_state(pool), owner.rows()
        with pytest.raises(error, match=match):
            call()
        assert torch.equal(_host_state(pool), host), match
        assert all(torch.equal(dev[k], v) for k, v in owner.rows().items()), match
    # An owner whose buffer no longer matches its declaration: refused before any part copies.
    key = "ngram.weights"
    real = owner.tensors[key]
    owner.tensors[key] = real[:, :, :2].clone()
    host, dev = _host_state(pool), owner.rows()
    for call in (lambda: pool.backup_from_device(_ids([3]), _ids([0])),
                 lambda: pool.load_to_device(_ids([2]), _ids([1]))):  # fmt: skip
        with pytest.raises(InvalidArgumentError, match="ngram.weights"):
            call()
    assert torch.equal(_host_state(pool), host)
    assert all(torch.equal(dev[k], v) for k, v in owner.rows().items())
    owner.tensors[key] = real
    pool.destroy()
    assert pool.nbytes == 0
    with pytest.raises(StateError):
        pool.backup_from_device(_ids([1]), _ids([0]))
    with pytest.raises(StateError):
        pool.get_page_bytes(0)


def test_slots_alloc_free_and_construction_checks(gen):
    owner = Owner(SPEC, gen)
    pool = _pool(owner, "page_first", num_slots=3)
    a = pool.alloc(2)
    assert pool.available_size() == 1 and pool.alloc(2) is None
    pool.free(a[:1])
    with pytest.raises(OwnershipError):
        pool.free(a[:1])
    assert pool.available_size() == 2 and pool.alloc(2) is not None
    with pytest.raises(InvalidArgumentError, match="non-empty"):
        HostStatePool([], 3, reserve_bytes=0)
    with pytest.raises(InvalidArgumentError, match="repeat"):
        HostStatePool([owner.decls[0], owner.decls[0]], 3, reserve_bytes=0)
    with pytest.raises(InvalidArgumentError, match="num_slots"):
        HostStatePool(owner.decls, 0, reserve_bytes=0)
    with pytest.raises(InvalidArgumentError, match="layout"):
        HostStatePool(owner.decls, 3, layout="token_first", reserve_bytes=0)
    with pytest.raises(HostMemoryError, match="lower num_slots"):
        HostStatePool(owner.decls, 3, reserve_bytes=1 << 62)
    if not cuda_available():
        with pytest.raises(BackendUnavailableError):
            HostStatePool(owner.decls, 3, pin=True, reserve_bytes=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_page_bytes_views_copies_and_size_checks(gen, layout):
    owner = Owner(SPEC, gen)
    pool = _pool(owner, layout)
    pool.alloc(NUM_SLOTS)
    pool.backup_from_device(torch.arange(1, 8), torch.arange(7))
    n = pool.page_nbytes
    assert (pool.num_pages, n) == (NUM_SLOTS, pool.slot_nbytes)
    assert pool.page_bytes_zero_copy is (layout != "layer_first")
    rows = pool.page_bytes_rows()
    if layout == "layer_first":
        assert rows is None
    else:
        assert rows.shape == (NUM_SLOTS, n)
        assert torch.equal(torch.from_numpy(rows[3].copy()), pool.get_page_bytes(3))
    page = pool.get_page_bytes(2)
    page[0] ^= 0xFF  # a view writes through in page_first layouts; a copy does not
    assert (pool.get_page_bytes(2)[0] == page[0]).item() is (layout != "layer_first")

    new = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    pool.set_page_bytes(4, new)
    assert torch.equal(pool.get_page_bytes(4), new)
    pool.set_page_bytes(5, bytes(new.roll(1).numpy()))
    assert torch.equal(pool.get_page_bytes(5), new.roll(1))
    pool.load_to_device(_ids([4]), _ids([8]))
    assert torch.equal(owner.slot_bytes(8), new)

    host = _host_state(pool)
    for slot, data, match in [
        (1, new[:-1], f"{n - 1} bytes"),
        (1, torch.cat([new, new[:1]]), f"{n + 1} bytes"),
        (1, b"", "0 bytes"),
        (1, bytearray(n - 3), f"{n - 3} bytes"),
        (1, new.view(torch.int8), "uint8"),
        (NUM_SLOTS, new, "valid slots"),
        (-1, new, "valid slots"),
        (True, new, "must be an int"),
    ]:
        with pytest.raises(InvalidArgumentError, match=match):
            pool.set_page_bytes(slot, data)
        assert torch.equal(_host_state(pool), host)
    for slot in (NUM_SLOTS, -1, 1.0):
        with pytest.raises(InvalidArgumentError):
            pool.get_page_bytes(slot)
