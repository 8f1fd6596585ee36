"""``python -m batchrules.bench.dp_overhead`` (where clipped_grad's time above
the non-private step goes) runs tiny and reports its slopes; the least-squares
fit is exact on a line. Timings are never asserted."""
import pytest

from batchrules.bench import dp_overhead
from batchrules.bench.timing import TimingPlan

PLAN = TimingPlan(block_s=0.001, budget_s=0.01, min_repeats=2, max_repeats=2, warmup_calls=0)


def test_slope_is_exact_on_a_line() -> None:
    assert dp_overhead.slope([1, 4, 16], [3 + 2 * x for x in (1, 4, 16)]) == pytest.approx((2, 3))


def test_runs_and_reports_per_layer_and_per_op_costs() -> None:
    lines = dp_overhead.run(layer_sweep=((1, 0), (2, 0)), op_sweep=((1, 0), (1, 2)), plan=PLAN)
    assert len(lines) == 1 + 3 + 1  # header, the three distinct configurations, the summary
    assert "per recorded linear layer" in lines[-1] and "per parameter-free op" in lines[-1]


def test_every_variant_computes_the_step() -> None:
    for variant in dp_overhead._variants(2, 1):
        assert variant.fn() is not None, variant.name
