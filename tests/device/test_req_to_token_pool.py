"""ReqToTokenPool: row allocation, generations, request binding, frees and writes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tiered_kv.device.req_to_token_pool import ReqToTokenPool, RequestKV
from tiered_kv.errors import InvalidArgumentError, OwnershipError

SIZE = 13
CTX = 37


def _pool(size: int = SIZE, ctx: int = CTX, **kw) -> ReqToTokenPool:
    return ReqToTokenPool(size, ctx, device="cpu", **kw)


def _state(pool: ReqToTokenPool) -> tuple:
    """Everything an allocation or free may change, as comparable copies."""
    return (
        pool.available_size(),
        list(pool.free_slots),
        pool.rows_in_use(),
        pool.req_generation.clone().tolist(),
        pool.req_to_token.clone(),
    )


def _assert_state(pool: ReqToTokenPool, state: tuple) -> None:
    avail, free_slots, in_use, gens, table = state
    assert pool.available_size() == avail
    assert pool.free_slots == free_slots
    assert pool.rows_in_use() == in_use
    assert pool.req_generation.tolist() == gens
    assert torch.equal(pool.req_to_token, table)


# -- construction -------------------------------------------------------------------------------
def test_construction_shapes():
    pool = _pool()
    assert pool.req_to_token.shape == (SIZE + 1, CTX)
    assert pool.req_to_token.dtype == torch.int32
    assert pool.req_generation.shape == (SIZE + 1,)
    assert pool.req_generation.tolist() == [0] * (SIZE + 1)
    assert pool.available_size() == SIZE
    assert pool.free_slots == list(range(1, SIZE + 1))
    assert pool.rows_in_use() == []


@pytest.mark.parametrize(
    "size, ctx, needle",
    [(0, 10, "size=0"), (-3, 10, "size=-3"), (4, 0, "max_context_len=0"), (True, 4, "size=True")],
)
def test_bad_construction_raises_naming_the_value(size, ctx, needle):
    with pytest.raises(InvalidArgumentError, match=needle):
        ReqToTokenPool(size, ctx, device="cpu")


# -- alloc_rows ---------------------------------------------------------------------------------
def test_row_zero_is_never_handed_out():
    pool = _pool()
    rows = pool.alloc_rows(SIZE)
    assert sorted(rows) == list(range(1, SIZE + 1))
    assert 0 not in rows
    assert pool.available_size() == 0
    assert pool.alloc_rows(1) is None
    assert pool.rows_in_use() == list(range(1, SIZE + 1))


def test_row_zero_is_never_handed_out_one_at_a_time():
    pool = _pool(size=6)
    got = [pool.alloc_rows(1) for _ in range(6)]
    assert all(len(r) == 1 for r in got)
    assert sorted(r[0] for r in got) == [1, 2, 3, 4, 5, 6]
    assert pool.alloc_rows(1) is None


def test_alloc_rows_pops_from_the_tail_of_free_slots():
    pool = _pool()
    assert pool.alloc_rows(3) == [11, 12, 13]
    assert pool.free_slots == list(range(1, 11))
    assert pool.alloc_rows(2) == [9, 10]
    # A freed row goes to the tail and is the next one handed out.
    pool.free([12, 9])
    assert pool.free_slots == [*range(1, 9), 12, 9]
    assert pool.alloc_rows(1) == [9]
    assert pool.alloc_rows(1) == [12]
    assert pool.free_slots == list(range(1, 9))


def test_alloc_rows_zero_returns_empty_and_changes_nothing():
    pool = _pool()
    pool.alloc_rows(4)
    state = _state(pool)
    assert pool.alloc_rows(0) == []
    _assert_state(pool, state)


def test_alloc_rows_zero_on_a_full_pool_returns_empty():
    pool = _pool(size=3)
    pool.alloc_rows(3)
    state = _state(pool)
    assert pool.alloc_rows(0) == []
    _assert_state(pool, state)


def test_alloc_rows_more_than_available_returns_none_and_changes_nothing():
    pool = _pool()
    pool.alloc_rows(5)
    state = _state(pool)
    assert pool.alloc_rows(SIZE - 5 + 1) is None
    _assert_state(pool, state)
    assert len(pool.alloc_rows(SIZE - 5)) == SIZE - 5


@pytest.mark.parametrize("bad", [-1, -7, 1.5, 2.0, "2", None, True, False])
def test_alloc_rows_bad_need_size_raises(bad):
    pool = _pool()
    pool.alloc_rows(2)
    state = _state(pool)
    with pytest.raises(InvalidArgumentError) as ei:
        pool.alloc_rows(bad)
    assert f"need_size={bad!r}" in str(ei.value)
    _assert_state(pool, state)


# -- generations --------------------------------------------------------------------------------
def test_generation_bumps_by_one_on_each_allocation():
    gen = torch.Generator().manual_seed(2024)
    pool = _pool()
    expected = [0] * (SIZE + 1)
    held: list[int] = []
    for _ in range(60):
        if held and torch.rand(1, generator=gen).item() < 0.45:
            k = int(torch.randint(1, len(held) + 1, (1,), generator=gen))
            perm = torch.randperm(len(held), generator=gen)[:k].tolist()
            victims = [held[i] for i in perm]
            pool.free(victims)
            held = [r for r in held if r not in victims]
        else:
            k = int(torch.randint(0, 5, (1,), generator=gen))
            rows = pool.alloc_rows(k)
            if rows is None:
                assert k > SIZE - len(held)
                continue
            for r in rows:
                expected[r] += 1
            held += rows
        assert pool.req_generation.tolist() == expected
        assert pool.available_size() == SIZE - len(held)
        assert pool.rows_in_use() == sorted(held)
    assert expected[0] == 0
    assert max(expected) >= 2  # some row was re-allocated


def test_clear_frees_everything_but_keeps_generations():
    pool = _pool()
    first = pool.alloc_rows(9)
    pool.free(first[:3])
    pool.alloc_rows(2)
    gens_before = pool.req_generation.clone()
    assert gens_before.sum() > 0

    pool.clear()

    assert pool.available_size() == SIZE
    assert pool.free_slots == list(range(1, SIZE + 1))
    assert pool.rows_in_use() == []
    assert torch.equal(pool.req_generation, gens_before)
    # A row allocated before clear is no longer held: freeing it is a double free.
    with pytest.raises(OwnershipError):
        pool.free(first[-1])

    rows = pool.alloc_rows(SIZE)
    after = pool.req_generation
    for r in rows:
        assert after[r] > gens_before[r]
        assert after[r] == gens_before[r] + 1
    assert after[0] == 0


# -- alloc(reqs) --------------------------------------------------------------------------------
def test_alloc_binds_rows_to_request_kv_objects():
    pool = _pool()
    reqs = [RequestKV() for _ in range(4)]
    rows = pool.alloc(reqs)
    assert rows == [r.req_pool_idx for r in reqs]
    assert sorted(rows) == [10, 11, 12, 13]
    assert all(r.holds_kv for r in reqs)
    assert pool.available_size() == SIZE - 4


def test_alloc_accepts_objects_with_a_kv_attribute():
    pool = _pool()
    wrapped = [SimpleNamespace(kv=RequestKV(), rid=f"r{i}") for i in range(3)]
    plain = RequestKV()
    rows = pool.alloc([wrapped[0], plain, wrapped[1], wrapped[2]])
    assert rows == [
        wrapped[0].kv.req_pool_idx,
        plain.req_pool_idx,
        wrapped[1].kv.req_pool_idx,
        wrapped[2].kv.req_pool_idx,
    ]
    assert len(set(rows)) == 4 and 0 not in rows


def test_alloc_rejects_objects_without_request_kv():
    pool = _pool()
    state = _state(pool)
    fresh = RequestKV()
    with pytest.raises(InvalidArgumentError, match="no RequestKV"):
        pool.alloc([fresh, SimpleNamespace(rid="x")])
    assert fresh.req_pool_idx is None
    _assert_state(pool, state)


@pytest.mark.parametrize("wrap", [False, True])
def test_chunked_prefill_request_keeps_its_row(wrap):
    pool = _pool()
    held = RequestKV()
    pool.alloc([held])
    held.kv_allocated_len = 23
    row = held.req_pool_idx
    gens = pool.req_generation.clone()
    avail = pool.available_size()

    a, b = RequestKV(), RequestKV()
    reqs = [a, held, b]
    if wrap:
        reqs = [SimpleNamespace(kv=kv) for kv in reqs]
    rows = pool.alloc(reqs)

    assert rows[1] == row and held.req_pool_idx == row
    assert held.kv_allocated_len == 23
    assert rows == [a.req_pool_idx, row, b.req_pool_idx]
    assert len(set(rows)) == 3
    assert pool.available_size() == avail - 2
    # Only the new rows' generations moved.
    changed = (pool.req_generation != gens).nonzero().flatten().tolist()
    assert sorted(changed) == sorted([a.req_pool_idx, b.req_pool_idx])


def test_alloc_with_only_reused_requests_takes_no_rows():
    pool = _pool()
    held = [RequestKV() for _ in range(2)]
    pool.alloc(held)
    for i, kv in enumerate(held):
        kv.kv_allocated_len = 5 + i
    state = _state(pool)
    rows = pool.alloc(held)
    assert rows == [kv.req_pool_idx for kv in held]
    _assert_state(pool, state)


def test_reused_request_without_allocated_kv_raises_and_binds_nothing():
    pool = _pool()
    held = RequestKV()
    pool.alloc([held])
    row = held.req_pool_idx
    assert held.kv_allocated_len == 0
    state = _state(pool)
    fresh = [RequestKV(), RequestKV()]
    with pytest.raises(OwnershipError) as ei:
        pool.alloc([fresh[0], held, fresh[1]])
    assert f"row {row}" in str(ei.value) and "kv_allocated_len=0" in str(ei.value)
    assert all(kv.req_pool_idx is None for kv in fresh)
    assert held.req_pool_idx == row
    _assert_state(pool, state)


@pytest.mark.parametrize("bad_row", ["free", 0, SIZE + 1, -1])
def test_reused_row_that_is_not_allocated_raises_and_binds_nothing(bad_row):
    pool = _pool()
    pool.alloc_rows(3)  # rows 11..13 in use
    row = 4 if bad_row == "free" else bad_row
    stale = RequestKV(req_pool_idx=row, kv_allocated_len=9)
    state = _state(pool)
    fresh = RequestKV()
    with pytest.raises(OwnershipError) as ei:
        pool.alloc([fresh, stale])
    assert f"row {row}" in str(ei.value)
    assert fresh.req_pool_idx is None
    assert stale.req_pool_idx == row and stale.kv_allocated_len == 9
    _assert_state(pool, state)


def test_alloc_short_of_rows_returns_none_and_binds_nothing():
    pool = _pool(size=5)
    held = RequestKV()
    pool.alloc([held])
    held.kv_allocated_len = 4
    pool.alloc_rows(2)  # 2 rows left
    state = _state(pool)
    fresh = [RequestKV() for _ in range(3)]
    assert pool.alloc([fresh[0], held, fresh[1], fresh[2]]) is None
    assert all(kv.req_pool_idx is None for kv in fresh)
    assert held.req_pool_idx is not None and held.kv_allocated_len == 4
    _assert_state(pool, state)
    # With exactly as many rows as needed it succeeds.
    assert pool.alloc([fresh[0], held, fresh[1]]) is not None
    assert pool.available_size() == 0


# -- free ---------------------------------------------------------------------------------------
HELD = list(range(6, SIZE + 1))  # what alloc_rows(8) takes from a fresh pool (the tail)


def _held_pool() -> tuple[ReqToTokenPool, list[int]]:
    pool = _pool()
    rows = pool.alloc_rows(8)
    assert rows == HELD
    return pool, rows


@pytest.mark.parametrize(
    "make",
    [
        lambda rows: rows[2],
        lambda rows: [rows[5], rows[0], rows[3]],
        lambda rows: (rows[1], rows[7]),
        lambda rows: torch.tensor([rows[4], rows[6]], dtype=torch.int32),
        lambda rows: torch.tensor([[rows[4]], [rows[6]]], dtype=torch.int64),
        lambda rows: torch.tensor(rows[3]),
    ],
    ids=["int", "list", "tuple", "tensor_i32", "tensor_2d", "tensor_0d"],
)
def test_free_rows(make):
    pool, rows = _held_pool()
    arg = make(rows)
    freed = (
        [int(x) for x in arg.reshape(-1).tolist()]
        if isinstance(arg, torch.Tensor)
        else [arg]
        if isinstance(arg, int)
        else list(arg)
    )
    before = list(pool.free_slots)
    pool.free(arg)
    assert pool.free_slots == before + freed
    assert pool.rows_in_use() == sorted(set(rows) - set(freed))
    assert pool.available_size() == SIZE - 8 + len(freed)


@pytest.mark.parametrize("wrap", [False, True])
def test_free_request_resets_its_row(wrap):
    pool = _pool()
    kv = RequestKV()
    other = RequestKV()
    pool.alloc([kv, other])
    kv.kv_allocated_len = 31
    row = kv.req_pool_idx
    pool.free(SimpleNamespace(kv=kv) if wrap else kv)
    assert kv.req_pool_idx is None
    assert kv.kv_allocated_len == 0
    assert pool.free_slots[-1] == row
    assert pool.rows_in_use() == [other.req_pool_idx]
    # The row comes back with a new generation.
    gen_before = int(pool.req_generation[row])
    pool.alloc([kv])
    assert kv.req_pool_idx == row
    assert int(pool.req_generation[row]) == gen_before + 1


def test_free_request_without_row_raises():
    pool, _ = _held_pool()
    state = _state(pool)
    with pytest.raises(OwnershipError, match="holds no row"):
        pool.free(RequestKV())
    _assert_state(pool, state)


def test_free_empty_is_a_no_op():
    pool, _ = _held_pool()
    state = _state(pool)
    pool.free([])
    pool.free(torch.empty(0, dtype=torch.int64))
    _assert_state(pool, state)


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda rows: 0, "[0]"),
        (lambda rows: [rows[0], 0], "[0]"),
        (lambda rows: SIZE + 1, f"[{SIZE + 1}]"),
        (lambda rows: [rows[1], -2], "[-2]"),
        (lambda rows: torch.tensor([rows[2], SIZE + 5]), f"[{SIZE + 5}]"),
        (lambda rows: 3, "[3]"),  # never allocated
        (lambda rows: [rows[3], 2, rows[4]], "[2]"),
        (lambda rows: [rows[1], rows[2], rows[1]], f"{HELD[1]}, {HELD[1]}"),
        (lambda rows: torch.tensor([rows[6], rows[6]]), f"{HELD[6]}, {HELD[6]}"),
        (lambda rows: RequestKV(req_pool_idx=1, kv_allocated_len=3), "[1]"),
    ],
    ids=[
        "row0",
        "row0_in_list",
        "past_end",
        "negative",
        "tensor_past_end",
        "not_in_use",
        "not_in_use_in_list",
        "duplicates",
        "tensor_duplicates",
        "request_on_free_row",
    ],
)
def test_bad_free_raises_and_frees_nothing(make, needle):
    pool, rows = _held_pool()
    arg = make(rows)
    state = _state(pool)
    with pytest.raises(OwnershipError) as ei:
        pool.free(arg)
    assert needle in str(ei.value)
    _assert_state(pool, state)
    if isinstance(arg, RequestKV):
        assert arg.req_pool_idx == 1 and arg.kv_allocated_len == 3


def test_double_free_raises_and_frees_nothing():
    pool, rows = _held_pool()
    pool.free(rows[:2])
    state = _state(pool)
    with pytest.raises(OwnershipError) as ei:
        pool.free([rows[2], rows[1]])
    assert f"[{rows[1]}]" in str(ei.value) and "not allocated" in str(ei.value)
    _assert_state(pool, state)
    assert rows[2] in pool.rows_in_use()


# -- callback, write ----------------------------------------------------------------------------
def test_on_alloc_rows_callback_receives_the_rows():
    seen: list[list[int]] = []
    pool = _pool(on_alloc_rows=lambda rows: seen.append(list(rows)))
    rows = pool.alloc_rows(3)
    assert seen == [rows]
    held = RequestKV()
    pool.alloc([held])
    held.kv_allocated_len = 2
    a, b = RequestKV(), RequestKV()
    pool.alloc([a, held, b])
    # Only the newly allocated rows are reported, in allocation order.
    assert seen[1] == [held.req_pool_idx]
    assert sorted(seen[2]) == sorted([a.req_pool_idx, b.req_pool_idx])
    assert len(seen) == 3
    # A failed allocation reports nothing.
    assert pool.alloc_rows(SIZE) is None
    assert len(seen) == 3


def test_write_stores_into_req_to_token():
    gen = torch.Generator().manual_seed(77)
    pool = _pool()
    background = torch.randint(1, 100_000, (SIZE + 1, CTX), generator=gen, dtype=torch.int32)
    pool.write((slice(None), slice(None)), background)
    assert torch.equal(pool.req_to_token, background)

    (row,) = pool.alloc_rows(1)
    slots = torch.randint(1, 100_000, (19,), generator=gen, dtype=torch.int32)
    pool.write((row, slice(5, 24)), slots)
    expected = background.clone()
    expected[row, 5:24] = slots
    assert torch.equal(pool.req_to_token, expected)

    # Scalar values and tensor indices work as with plain indexing.
    pool.write((row, torch.tensor([0, 30, 36])), 4242)
    expected[row, [0, 30, 36]] = 4242
    assert torch.equal(pool.req_to_token, expected)


def test_available_size_tracks_allocs_and_frees():
    pool = _pool()
    assert pool.available_size() == SIZE
    a = pool.alloc_rows(5)
    assert pool.available_size() == SIZE - 5
    reqs = [RequestKV() for _ in range(3)]
    pool.alloc(reqs)
    assert pool.available_size() == SIZE - 8
    pool.free(a[1:4])
    assert pool.available_size() == SIZE - 5
    pool.free(reqs[0])
    assert pool.available_size() == SIZE - 4
    pool.clear()
    assert pool.available_size() == SIZE


def test_alloc_refuses_the_same_request_twice_and_two_claims_on_one_row():
    pool = ReqToTokenPool(4, 8, "cpu")
    kv = RequestKV()
    with pytest.raises(InvalidArgumentError, match="same request appears twice"):
        pool.alloc([kv, kv])
    assert pool.available_size() == 4 and kv.req_pool_idx is None
    (row,) = pool.alloc([RequestKV()])
    a = RequestKV(req_pool_idx=row, kv_allocated_len=3)
    b = RequestKV(req_pool_idx=row, kv_allocated_len=5)
    with pytest.raises(OwnershipError, match=f"same row among \\[{row}, {row}\\]"):
        pool.alloc([a, b, RequestKV()])
    assert pool.available_size() == 3
