"""KVWriteLoc: validation and narrowing of sub-locs, the physical mark, and for_batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tiered_kv.device.write_loc import KVWriteLoc, as_write_loc, write_loc_is_physical
from tiered_kv.errors import InvalidArgumentError


def _ids(gen: torch.Generator, n: int, high: int = 5000, dtype=torch.int64) -> torch.Tensor:
    """``n`` distinct random slot ids in [1, high), never an all-zero tensor."""
    return (torch.randperm(high - 1, generator=gen)[:n] + 1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_sub_locs_longer_than_loc_are_narrowed_to_its_length(dtype):
    gen = torch.Generator().manual_seed(101)
    loc = _ids(gen, 7, dtype=dtype)
    swa = _ids(gen, 13, dtype=dtype)
    full = _ids(gen, 11, dtype=dtype)
    swa_before, full_before = swa.clone(), full.clone()

    wl = KVWriteLoc(loc, swa_loc=swa, full_loc=full)

    assert wl.loc is loc
    assert len(wl) == 7
    assert wl.swa_loc.shape == (7,) and wl.full_loc.shape == (7,)
    # Narrowing keeps the leading values in order (one shared per-token order).
    assert torch.equal(wl.swa_loc, swa_before[:7])
    assert torch.equal(wl.full_loc, full_before[:7])
    # The caller's tensors are not modified.
    assert torch.equal(swa, swa_before) and torch.equal(full, full_before)


def test_sub_loc_of_equal_length_is_kept_as_given():
    gen = torch.Generator().manual_seed(102)
    loc, swa, full = _ids(gen, 9), _ids(gen, 9), _ids(gen, 9)
    wl = KVWriteLoc(loc, swa_loc=swa, full_loc=full)
    assert wl.swa_loc is swa and wl.full_loc is full


@pytest.mark.parametrize("name", ["swa_loc", "full_loc"])
def test_sub_loc_shorter_than_loc_raises(name):
    gen = torch.Generator().manual_seed(103)
    loc, short = _ids(gen, 9), _ids(gen, 5)
    loc_before, short_before = loc.clone(), short.clone()
    with pytest.raises(InvalidArgumentError) as ei:
        KVWriteLoc(loc, **{name: short})
    msg = str(ei.value)
    assert f"KVWriteLoc.{name}" in msg
    assert "has 5 entries" in msg and "loc has 9" in msg
    assert torch.equal(loc, loc_before) and torch.equal(short, short_before)


@pytest.mark.parametrize(
    "bad, needle",
    [
        (torch.tensor([3.0, 1.5, 7.0]), "torch.float32"),
        (torch.tensor([True, False, True]), "torch.bool"),
        (torch.tensor([4, 9, 2], dtype=torch.int16), "torch.int16"),
        (torch.tensor([[3, 1], [7, 2]]), "(2, 2)"),
        (torch.tensor(5), "shape ()"),
        ([3, 1, 7], "list"),
    ],
    ids=["float", "bool", "int16", "2d", "0d", "list"],
)
def test_bad_loc_raises_naming_the_bad_value(bad, needle):
    before = bad.clone() if isinstance(bad, torch.Tensor) else list(bad)
    with pytest.raises(InvalidArgumentError) as ei:
        KVWriteLoc(bad)
    assert "KVWriteLoc.loc" in str(ei.value)
    assert needle in str(ei.value)
    if isinstance(bad, torch.Tensor):
        assert torch.equal(bad, before)
    else:
        assert bad == before


@pytest.mark.parametrize("name", ["swa_loc", "full_loc"])
def test_bad_sub_loc_dtype_raises(name):
    gen = torch.Generator().manual_seed(104)
    loc = _ids(gen, 6)
    bad = torch.rand(6, generator=gen) + 1.0
    with pytest.raises(InvalidArgumentError) as ei:
        KVWriteLoc(loc, **{name: bad})
    assert f"KVWriteLoc.{name}" in str(ei.value) and "torch.float32" in str(ei.value)


@pytest.mark.parametrize("mark", [True, False])
def test_for_batch_carries_the_physical_mark(mark):
    gen = torch.Generator().manual_seed(105 + int(mark))
    loc = _ids(gen, 17)
    batch = SimpleNamespace(out_cache_loc=loc, out_cache_loc_is_physical=mark)
    wl = KVWriteLoc.for_batch(batch)
    assert wl.loc is loc
    assert wl.physical is mark
    assert write_loc_is_physical(wl) is mark
    assert wl.swa_loc is None and wl.full_loc is None


def test_for_batch_defaults_to_not_physical_without_the_attribute():
    gen = torch.Generator().manual_seed(107)
    batch = SimpleNamespace(out_cache_loc=_ids(gen, 5))
    wl = KVWriteLoc.for_batch(batch)
    assert wl.physical is False
    assert write_loc_is_physical(wl) is False


def test_for_batch_sub_locs_travel_under_the_batch_mark_and_are_narrowed():
    gen = torch.Generator().manual_seed(108)
    loc, swa, full = _ids(gen, 6), _ids(gen, 10), _ids(gen, 6)
    batch = SimpleNamespace(out_cache_loc=loc, out_cache_loc_is_physical=True)
    wl = KVWriteLoc.for_batch(batch, swa_loc=swa, full_loc=full)
    assert wl.physical is True
    assert torch.equal(wl.swa_loc, swa[:6])
    assert wl.full_loc is full
    assert wl.target_full_loc is full


@pytest.mark.parametrize(
    "batch",
    [SimpleNamespace(), SimpleNamespace(out_cache_loc=None, out_cache_loc_is_physical=True)],
    ids=["missing", "none"],
)
def test_for_batch_without_out_cache_loc_raises(batch):
    before = dict(vars(batch))
    with pytest.raises(InvalidArgumentError) as ei:
        KVWriteLoc.for_batch(batch)
    assert "SimpleNamespace" in str(ei.value) and "out_cache_loc" in str(ei.value)
    assert vars(batch) == before


def test_bare_tensor_is_not_physical_and_as_write_loc_wraps_it_unmarked():
    gen = torch.Generator().manual_seed(109)
    loc = _ids(gen, 8, dtype=torch.int32)
    assert write_loc_is_physical(loc) is False
    wl = as_write_loc(loc)
    assert isinstance(wl, KVWriteLoc)
    assert wl.loc is loc and wl.physical is False
    marked = KVWriteLoc(loc, physical=True)
    assert write_loc_is_physical(marked) is True
    assert as_write_loc(marked) is marked


def test_target_full_loc_falls_back_to_loc():
    gen = torch.Generator().manual_seed(110)
    loc, full = _ids(gen, 12), _ids(gen, 12)
    assert KVWriteLoc(loc).target_full_loc is loc
    assert KVWriteLoc(loc, swa_loc=_ids(gen, 12)).target_full_loc is loc
    assert KVWriteLoc(loc, full_loc=full).target_full_loc is full


def test_empty_loc_is_valid():
    wl = KVWriteLoc(torch.empty(0, dtype=torch.int64), swa_loc=torch.tensor([4, 8]))
    assert len(wl) == 0
    assert wl.swa_loc.shape == (0,)
