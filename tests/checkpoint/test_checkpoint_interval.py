"""The checkpoint-interval policy: the chosen step count minimises expected lost time."""
import math

import pytest

from ms_llm.errors import ConfigError
from ms_llm.run.interval import IntervalInputs, choose_interval, wasted_per_hour


@pytest.mark.parametrize("stall,total,iter_s,restore,mtbf", [
    (0.5, 20.0, 1.2, 60.0, 24.0), (2.0, 2.5, 0.3, 30.0, 2.0), (0.05, 0.05, 5.0, 10.0, 100.0)])
def test_chosen_interval_is_the_best_whole_step_count(stall, total, iter_s, restore, mtbf):
    x = IntervalInputs(stall, total, iter_s, restore, mtbf)
    d = choose_interval(x)
    allowed = [n for n in range(1, 20 * d.steps + 10) if n * iter_s >= max(total, iter_s)]
    best = min(allowed, key=lambda n: wasted_per_hour(x, n * iter_s))
    assert wasted_per_hour(x, d.steps * iter_s) == pytest.approx(wasted_per_hour(x, best * iter_s), rel=1e-12)
    assert d.seconds == pytest.approx(d.steps * iter_s)
    assert "sqrt(2*t_stall*MTBF)" in d.report()


def test_young_optimum_and_the_constraint():
    d = choose_interval(IntervalInputs(0.5, 20.0, 1.2, 60.0, 24.0))
    assert abs(d.steps * 1.2 - math.sqrt(2 * 0.5 * 24 * 3600)) <= 1.2          # tau* = 293.9 s
    slow_save = choose_interval(IntervalInputs(0.001, 30.0, 1.0, 0.0, 24.0))     # a save takes 30 s
    assert slow_save.steps == 30 and "constraint" in slow_save.report()


def test_bad_inputs_name_the_field():
    with pytest.raises(ConfigError, match="mtbf_hours"):
        IntervalInputs(1.0, 2.0, 1.0, 1.0, 0.0)
    with pytest.raises(ConfigError, match="total_s"):
        IntervalInputs(3.0, 2.0, 1.0, 1.0, 1.0)
