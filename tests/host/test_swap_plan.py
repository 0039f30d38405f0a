"""The swap-in bookkeeping's two implementations give the same plans, the same stamps and the
same refusals (nothing changed), on random maps, selections and bad input."""

from __future__ import annotations

import numpy as np
import pytest

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.host.swap_plan import NativePlanner, plan_numpy, planner
from tiered_kv.kernels import native_build

NATIVE = pytest.mark.skipif(
    native_build.load_swap_plan() is None, reason="native swap-in bookkeeping not built"
)


def _layer(rng: np.random.Generator, n: int, b: int, newest: bool):
    """A layer's state: up to b of n positions resident at distinct buffer indices, the
    newest one (n - 1) at index b when pending, and last uses in the past (entry b of the
    last uses is scratch: the numpy plan stamps it, nothing reads it)."""
    index_of = np.full(n + 5, -1, dtype=np.int32)
    held = rng.choice(n - newest, size=rng.integers(0, min(b, n - newest) + 1), replace=False)
    index_of[held] = rng.choice(b, size=held.size, replace=False)
    if newest:
        index_of[n - 1] = b
    lru = rng.integers(-1, 50, size=b + 1).astype(np.int64)
    return index_of, lru


def _selection(rng: np.random.Generator, n: int, b: int, bad: str | None) -> np.ndarray:
    k = int(rng.integers(0, min(n, b + 1) + 1))
    sel = rng.choice(n, size=k, replace=False).astype(np.int64)
    if bad == "repeat" and k:
        sel = np.append(sel, sel[rng.integers(0, k)])
        rng.shuffle(sel)
    elif bad == "range":
        sel = np.append(sel, rng.choice([n, n + 3, -1, -7]))
        rng.shuffle(sel)
    elif bad == "many":
        sel = rng.choice(n, size=min(n, b + 2), replace=False).astype(np.int64)
    return sel


@NATIVE
@pytest.mark.parametrize("seed", range(4))
def test_native_and_numpy_plans_agree(seed):
    rng = np.random.default_rng(seed)
    planners = {}
    for trial in range(400):
        b = int(rng.integers(1, 40))
        n = int(rng.integers(2, 90))
        newest = bool(rng.integers(0, 2))
        bad = rng.choice([None, None, "repeat", "range", "many"])
        index_of, lru = _layer(rng, n, b, newest)
        sel = _selection(rng, n, b, bad)
        clock = 60 + trial
        native = planners.setdefault(b, NativePlanner(b))
        got = {}
        for name, plan in (("native", native), ("numpy", plan_numpy)):
            io, lr = index_of.copy(), lru.copy()
            try:
                p = plan(sel, n, io, lr, b, clock)
                got[name] = ("ok", p.slot_of.tolist(), p.missing.tolist(), p.newest,
                             p.free.tolist(), io.tolist(), lr[:b].tolist())  # fmt: skip
            except InvalidArgumentError as e:
                # refused: nothing changed
                assert io.tolist() == index_of.tolist() and lr[:b].tolist() == lru[:b].tolist()
                got[name] = ("refused", str(e).split(";")[0].split(" got")[0])
        assert got["native"] == got["numpy"], (trial, sel.tolist(), bad)
        if got["numpy"][0] == "ok":
            _, slot_of, missing, nn, free, io, lr = got["numpy"]
            assert slot_of == index_of[sel].tolist()
            assert missing == [i for i, s in enumerate(slot_of) if s < 0]
            assert nn == sum(s == b for s in slot_of)
            used = {s for s in slot_of if 0 <= s < b}
            assert free == [s for s in range(b) if s not in used]
            assert all(lr[s] == clock for s in used) and io == index_of.tolist()
        elif bad is None and sel.size - (newest and n - 1 in sel) <= b:
            pytest.fail(f"a good selection refused: {got['numpy']}")


def test_planner_modes():
    b = 8
    assert planner("numpy", b) is plan_numpy
    auto = planner("auto", b)
    assert isinstance(auto, NativePlanner) == (native_build.load_swap_plan() is not None)
    with pytest.raises(InvalidArgumentError, match="plan_mode='fast'"):
        planner("fast", b)
