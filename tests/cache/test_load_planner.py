"""The load planner's bookkeeping: link estimates fitted to observed ops (priors first, then
the data; a link that changes is followed), and the cut choice (every page cut priced, the
cheapest taken, ties to the longer cut) on fresh random numbers and irregular page sizes: a
storage hit is never taken when recomputing it is faster, and is taken when loading is; the cut
moves the right way as a link or the compute gets slower; a position-dependent compute cost
(attention) makes the same hit worth loading later in a prompt."""

from __future__ import annotations

import math
import re

import pytest
import torch

from tiered_kv.cache.load_planner import LinkEstimate, LoadPlanner, PlannerPriors, best_cut
from tiered_kv.cache.prefix_match import PrefixMatch
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import Direction
from tiered_kv.transfer.stats import DirectionStats


def uniform(gen: torch.Generator, lo: float, hi: float) -> float:
    return lo + (hi - lo) * float(torch.rand((), generator=gen))


def randint(gen: torch.Generator, lo: int, hi: int) -> int:
    return int(torch.randint(lo, hi + 1, (), generator=gen))


# -- the link estimate ------------------------------------------------------------------------
def test_the_prior_is_the_estimate_until_something_is_observed():
    est = LinkEstimate(3e9, 2e-4)
    assert est.bytes_per_s == pytest.approx(3e9) and est.op_s == 2e-4
    assert est.seconds(0) == 0.0
    assert est.seconds(3e9) == pytest.approx(1 + 2e-4)
    assert est.observed_ops == 0


def test_the_estimate_converges_to_the_observed_line(gen):
    op_s, bw = uniform(gen, 1e-5, 1e-3), uniform(gen, 0.05e9, 30e9)
    est = LinkEstimate(uniform(gen, 1e9, 50e9), uniform(gen, 0, 1e-3))  # a wrong prior
    for _ in range(300):
        nbytes = randint(gen, 1, 4000) * 4096 + randint(gen, 0, 4095)  # irregular sizes
        est.observe(nbytes, op_s + nbytes / bw)
    assert est.bytes_per_s == pytest.approx(bw, rel=1e-6)
    assert est.op_s == pytest.approx(op_s, rel=1e-6, abs=1e-12)
    assert est.observed_ops == 300


def test_a_link_that_slows_down_is_followed(gen):
    bw = uniform(gen, 5e9, 25e9)
    est = LinkEstimate(bw, 0.0)
    sizes = [randint(gen, 1 << 16, 1 << 26) for _ in range(400)]
    for n in sizes[:200]:
        est.observe(n, n / bw)
    for n in sizes[200:]:
        est.observe(n, n / (bw / 10))
    assert est.bytes_per_s == pytest.approx(bw / 10, rel=1e-3)


def test_one_op_moves_the_estimate_part_way_and_aggregates_count_per_op(gen):
    bw = uniform(gen, 0.01e9, 0.1e9)
    prior = LinkEstimate(6e9, 1e-4)
    one = LinkEstimate(6e9, 1e-4)
    n = randint(gen, 1 << 20, 1 << 24)
    one.observe(n, n / bw)
    # Part way (one op against a prior of two, decayed once) toward the observed time.
    share = 1 / (1 + 2 * 0.9)
    assert prior.seconds(n) < one.seconds(n) < n / bw
    assert one.seconds(n) == pytest.approx(share * n / bw + (1 - share) * prior.seconds(n))
    four = LinkEstimate(6e9, 1e-4)
    four.observe(4 * n, 4 * n / bw, ops=4)  # four ops of n bytes each
    assert four.observed_ops == 4 and four.seconds(n) > one.seconds(n)


def test_ops_of_one_size_charge_every_second_to_bandwidth(gen):
    n, t = randint(gen, 1 << 20, 1 << 24), uniform(gen, 1e-3, 1e-1)
    est = LinkEstimate(25e9, 1e-3)
    for _ in range(400):
        est.observe(n, t)
    assert est.seconds(n) == pytest.approx(t, rel=1e-9)
    assert est.op_s == pytest.approx(0.0, abs=1e-15)  # the prior's share has faded
    assert est.seconds(2 * n) == pytest.approx(2 * t, rel=1e-9)  # bigger never looks free


@pytest.mark.parametrize(
    "args, kwargs, needle",
    [
        ((0, 1e-4), {}, "bytes_per_s=0"),
        ((1e9, -1), {}, "op_s=-1"),
        ((1e9, 0), {"alpha": 1.0}, "alpha=1.0"),
        ((math.inf, 0), {}, "bytes_per_s=inf"),
    ],
)
def test_bad_estimate_arguments_are_refused(args, kwargs, needle):
    with pytest.raises(InvalidArgumentError, match=re.escape(needle)):
        LinkEstimate(*args, **kwargs)


def test_bad_observations_are_refused():
    est = LinkEstimate(1e9, 0)
    for args, needle in (((0, 1.0), "nbytes=0"), ((10, -1.0), "seconds=-1"), ((10, 1, 0), "ops")):
        with pytest.raises(InvalidArgumentError, match=needle):
            est.observe(*args)
    assert est.observed_ops == 0


# -- the cut --------------------------------------------------------------------------------
def _brute(device, host, storage, ps, load_s, compute_s):
    end = device + host + storage
    costs = {}
    for cut in range(device, end + 1, ps):
        h = min(cut, device + host) - device
        s = max(0, cut - device - host)
        costs[cut] = load_s(h, s) + (compute_s(end - cut, cut) if cut < end else 0.0)
    low = min(costs.values())
    return max(c for c, v in costs.items() if v == low)  # ties: the longer cut


def _planner(ps, bpt, host_bw, storage_bw, host_op=0.0, storage_op=0.0, rate=30_000.0):
    """A planner that trusts its priors (no first-load probe)."""
    priors = PlannerPriors(host_bw, storage_bw, host_op, storage_op, rate)
    return LoadPlanner(ps, bpt, priors, probe_tokens=ps << 20)


def _match(device, host, storage, ps) -> PrefixMatch:
    keys = [bytes([i % 256]) * 8 for i in range(storage // ps)]
    return PrefixMatch(torch.empty(0), None, None, device, host, storage, keys)


@pytest.mark.parametrize("ps", [1, 7, 13, 64])
def test_the_cut_is_the_cheapest_page_cut(gen, ps):
    for _ in range(20):
        d, h, s = (randint(gen, 0, 12) * ps for _ in range(3))
        p = _planner(
            ps, randint(gen, 100, 300_000), uniform(gen, 0.5e9, 30e9), uniform(gen, 0.01e9, 8e9),
            uniform(gen, 0, 1e-3), uniform(gen, 0, 1e-2), uniform(gen, 1e3, 1e5),
        )  # fmt: skip
        att = uniform(gen, 0, 1e-9)  # an attention term: later tokens cost more

        def compute(n, ctx, p=p, att=att):
            return n / p.priors.prefill_tokens_per_s + att * n * (2 * ctx + n)

        p.set_compute_cost(compute)
        want = _brute(d, h, s, ps, p.load_s, compute)
        assert p.plan(_match(d, h, s, ps)) == want
        assert d <= want <= d + h + s and (want - d) % ps == 0


def test_a_concave_compute_cost_can_cut_inside_a_tier():
    # The first tokens are dear to compute, the rest nearly free: load a few pages only.
    def compute(n, ctx):
        return sum(1.0 if i < 24 else 1e-9 for i in range(ctx, ctx + n))

    cut = best_cut(0, 80, 0, 8, lambda h, s: 0.3 * h, compute)
    assert cut == 24 == _brute(0, 80, 0, 8, lambda h, s: 0.3 * h, compute)


@pytest.mark.parametrize("ps", [5, 16])
def test_a_storage_hit_is_taken_only_when_loading_beats_recomputing(gen, ps):
    bpt, rate = randint(gen, 1 << 10, 1 << 18), uniform(gen, 5e3, 5e4)
    compute_per_token = 1 / rate
    # Loading one token from storage, over both links, against computing it.
    for _ in range(20):
        d, h, s = randint(gen, 0, 8) * ps, randint(gen, 0, 8) * ps, randint(gen, 1, 16) * ps
        host_bw = uniform(gen, 10e9, 30e9)
        factor = uniform(gen, 1.05, 20)
        slow_bw = bpt / (compute_per_token * factor)  # slower than recomputing by ``factor``
        slow = _planner(ps, bpt, host_bw, slow_bw, rate=rate)
        assert slow.plan(_match(d, h, s, ps)) <= d + h, "a storage hit slower than computing"
        fast_bw = bpt * factor / compute_per_token * 2  # both links well under compute
        fast = _planner(ps, bpt, max(host_bw, fast_bw), fast_bw, rate=rate)
        assert fast.plan(_match(d, h, s, ps)) == d + h + s


def test_the_cut_moves_the_right_way(gen):
    ps, bpt = 16, 128 << 10
    d, h, s = 2 * ps, 10 * ps, 20 * ps
    cuts = []
    for gbps in (64, 16, 8, 6, 4, 2, 1, 0.25, 0.01):  # a slower and slower disk
        p = _planner(ps, bpt, 25e9, gbps * 1e9, 1e-5, 1e-4)
        cuts.append(p.plan(_match(d, h, s, ps)))
    assert cuts == sorted(cuts, reverse=True) and cuts[0] == d + h + s and cuts[-1] == d + h
    cuts = []
    for rate in (1e3, 1e4, 3e4, 1e5, 1e6, 1e8):  # faster and faster compute
        p = _planner(ps, bpt, 10e9, 3e9, 1e-5, 1e-4, rate=rate)
        cuts.append(p.plan(_match(d, h, s, ps)))
    assert cuts == sorted(cuts, reverse=True) and cuts[0] == d + h + s and cuts[-1] == d


def test_attention_makes_a_later_hit_worth_loading():
    ps, bpt, rate = 16, 128 << 10, 30_000.0
    storage_bw = bpt * rate / 1.2  # per token a little slower than a linear-cost prefill
    p = _planner(ps, bpt, 1e15, storage_bw, rate=rate)
    assert p.plan(_match(0, 0, 64, ps)) == 0  # linear cost: recompute
    p.set_compute_cost(lambda n, ctx: n / rate * (1 + (ctx + n / 2) / 8192))
    assert p.plan(_match(0, 0, 64, ps)) == 0  # near the start: still recompute
    assert p.plan(_match(32_768, 0, 64, ps)) == 32_768 + 64  # deep in a prompt: load


def test_the_first_storage_load_is_a_probe_of_the_link(gen):
    ps = randint(gen, 3, 17)
    p = LoadPlanner(ps, 4096, PlannerPriors(prefill_tokens_per_s=100.0), probe_tokens=2 * ps)
    d, h, s = ps, 3 * ps, 10 * ps
    assert p.plan(_match(d, h, s, ps)) == d + h + 2 * ps  # the prior says load: two pages
    p.links[Direction.STORAGE_TO_HOST].observe(2 * ps * 4096, 2 * ps * 4096 / 6e9)
    assert p.plan(_match(d, h, s, ps)) == d + h + s  # observed: the whole hit
    with pytest.raises(InvalidArgumentError, match="probe_tokens=5 is invalid: a whole number"):
        LoadPlanner(4, 1, PlannerPriors(), probe_tokens=5)


# -- feeding it ------------------------------------------------------------------------------
def test_the_load_source_is_read_as_deltas_leaving_failed_ops_out():
    totals = {d.value: DirectionStats() for d in Direction}
    p = _planner(16, 1024, 25e9, 6e9, 1e-5, 1e-4)
    totals["storage_to_host"] = DirectionStats(10 << 20, 1.0, 5, 0)  # before: the baseline
    p.set_load_source(lambda: dict(totals))
    p.refresh()
    assert p.links[Direction.STORAGE_TO_HOST].observed_ops == 0
    totals["storage_to_host"] = DirectionStats(30 << 20, 3.0, 9, 2)  # 2 more ok, 2 failed
    totals["host_to_device"] = DirectionStats(4 << 20, 0.002, 1, 0)
    p.refresh()
    assert p.links[Direction.STORAGE_TO_HOST].observed_ops == 2
    assert p.links[Direction.HOST_TO_DEVICE].observed_ops == 1
    p.refresh()  # nothing new
    assert p.links[Direction.STORAGE_TO_HOST].observed_ops == 2
    est = p.estimates()
    assert set(est) == {"host_to_device", "storage_to_host", "compute"}
    assert est["compute"] == "prior" and est["storage_to_host"]["observed_ops"] == 2


def test_planner_arguments_are_checked():
    priors = PlannerPriors()
    with pytest.raises(InvalidArgumentError, match="page_size=0"):
        LoadPlanner(0, 1, priors)
    with pytest.raises(InvalidArgumentError, match="priors must be PlannerPriors"):
        LoadPlanner(16, 1, {"host_bytes_per_s": 1})
    p = LoadPlanner(16, 1024, priors)
    with pytest.raises(InvalidArgumentError, match="compute cost must be callable"):
        p.set_compute_cost(3.0)
    with pytest.raises(InvalidArgumentError, match="load source must be callable"):
        p.set_load_source({})
    p.set_compute_cost(lambda n, ctx: -1.0)
    with pytest.raises(InvalidArgumentError, match=r"returned -1.0; it must be seconds >= 0"):
        p.plan(_match(0, 32, 0, 16))
    assert p.compute_source == "engine"
