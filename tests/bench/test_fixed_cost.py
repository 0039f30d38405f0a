import pytest
import torch

from tiered_kv.bench.fixed_cost import PAGE_COUNTS, fit, measure_fixed_cost
from tiered_kv.bench.transfer import Geometry
from tiered_kv.names import Direction


def test_fit_recovers_intercept_and_slope():
    points = [(b, 5e-5 + b / 2e9) for b in (100, 1_000, 10_000, 123_457)]
    intercept, slope = fit(points)
    assert intercept == pytest.approx(5e-5, rel=1e-6)
    assert slope == pytest.approx(1 / 2e9, rel=1e-6)


def test_measure_fixed_cost_covers_every_direction_and_page_count():
    costs = measure_fixed_cost(Geometry(2, 1, 8, torch.float32), 1, repeats=1)
    assert [c.direction for c in costs] == [str(d) for d in Direction]
    for c in costs:
        assert [b for b, _ in c.points] == [n * c.points[0][0] for n in PAGE_COUNTS]
        assert all(s > 0 for _, s in c.points)
