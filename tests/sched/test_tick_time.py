"""engine_lib/sched/tick_time.py: a step's seconds for its cost, fitted to the ticks."""

from __future__ import annotations

import pytest

from engine_lib.sched.tick_time import TickTimeModel


def close(a: float, b: float) -> bool:
    return abs(a - b) < 1e-9


def test_ticks_of_two_costs_give_the_fixed_part_and_the_part_per_cost():
    model = TickTimeModel()
    for _ in range(3):
        model.observe(100, 0.5 + 0.001 * 100)
        model.observe(300, 0.5 + 0.001 * 300)
    assert close(model.fixed_s, 0.5) and close(model.per_cost_s, 0.001)
    assert close(model.seconds(200), 0.7)
    assert model.joining_saves_time(100, 100)  # 0.7 s for both vs 1.2 s apart


def test_before_any_tick_nothing_takes_time_and_before_two_costs_batching_is_tried():
    model = TickTimeModel()
    assert not model.measured and model.seconds(100) == 0.0 and model.joining_saves_time(100, 100)
    model.observe(100, 0.4)
    assert model.measured and model.fixed_s is None
    assert close(model.seconds(200), 0.8)  # in proportion to cost: the safe side for deadlines
    assert model.joining_saves_time(100, 100)  # unknown: a shared step is how it gets measured


def test_when_a_shared_step_costs_as_much_as_two_joining_is_not_worth_it():
    model = TickTimeModel()
    for _ in range(3):
        model.observe(1, 1.0)
        model.observe(2, 2.0)
    assert close(model.fixed_s, 0.0) and not model.joining_saves_time(1, 1)


def test_noise_that_would_make_more_rows_cheaper_counts_as_no_fixed_part():
    model = TickTimeModel()
    model.observe(1, 1.0)
    model.observe(2, 0.9)  # a slow solo tick, say
    assert model.fixed_s == 0.0 and model.per_cost_s > 0 and not model.joining_saves_time(1, 1)


def test_the_fit_follows_the_machine_when_it_slows_down():
    model = TickTimeModel(decay=0.9)
    for _ in range(20):
        model.observe(1, 1.0)
        model.observe(2, 1.5)
    for _ in range(60):  # twice as slow now
        model.observe(1, 2.0)
        model.observe(2, 3.0)
    assert abs(model.seconds(1) - 2.0) < 0.01 and abs(model.seconds(2) - 3.0) < 0.01


def test_ticks_without_cost_or_time_teach_nothing_and_the_decay_is_checked():
    model = TickTimeModel()
    model.observe(0, 1.0)
    model.observe(1, 0.0)
    assert not model.measured
    with pytest.raises(ValueError, match="decay"):
        TickTimeModel(decay=0.0)
