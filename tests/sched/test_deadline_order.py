"""`admission_order=deadline`: earliest deadline first among requests that can still finish by theirs (at the
measured seconds per step), then requests without one, then those that cannot make it any more; preemption of
a running request that is less pressing; the `max_head_bypass` bound (hand-made runner outputs and a fake
clock, no model)."""

from __future__ import annotations

from engine_lib.sched import SchedulerOutput, StepScheduler, step_batch_key
from tests.sched.test_priorities import add, req, tick


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def edf(max_num_seqs=1, max_preemptions=1, max_head_bypass=16, seconds_per_step=1.0) -> tuple[StepScheduler, Clock]:
    """Every request costs 1 per step, and a step takes `seconds_per_step` (as if measured)."""
    sched = StepScheduler(max_num_seqs, lambda p: step_batch_key(p, ("height",)), max_head_bypass,
                          cost_fn=lambda p: 1, max_preemptions=max_preemptions, admission_order="deadline")
    sched.clock = clock = Clock()
    sched.seconds_per_cost = seconds_per_step
    return sched, clock


def run_all(sched, clock, seconds_per_tick=1.0) -> tuple[list[str], list[str]]:
    """Tick (the clock advancing) until every request has ended: (admission order, end order)."""
    admitted, ended = [], []
    while sched.has_requests:
        out, done = tick(sched)
        clock.now += seconds_per_tick
        admitted += out.new_ids
        ended += done
    return admitted, ended


def test_the_earliest_deadline_goes_first_then_requests_without_one_in_arrival_order():
    sched, clock = edf(max_preemptions=0)
    add(sched, req("none-old", steps=2), req("late-deadline", steps=2, deadline=100.0),
        req("none-new", steps=2), req("early-deadline", steps=2, deadline=50.0))
    assert run_all(sched, clock)[0] == ["early-deadline", "late-deadline", "none-old", "none-new"]


def test_a_request_that_can_no_longer_make_its_deadline_goes_last():
    """`hopeless` needs 4 s of steps but has 3 s: it would be late anyway, and running it first would
    make `tight` (4 s of work, 5 s left) late too."""
    sched, clock = edf(max_preemptions=0)
    add(sched, req("hopeless", steps=4, deadline=3.0), req("tight", steps=4, deadline=5.0),
        req("no-deadline", steps=1))
    admitted, ended = run_all(sched, clock)
    assert admitted == ["tight", "no-deadline", "hopeless"]
    assert ended.index("tight") == 0


def test_among_hopeless_requests_the_least_work_left_goes_first():
    sched, clock = edf(max_preemptions=0)
    add(sched, req("long", steps=8, deadline=1.0), req("short", steps=2, deadline=1.0))
    assert run_all(sched, clock)[0] == ["short", "long"]


def test_before_any_tick_is_measured_every_deadline_counts_as_reachable():
    sched, clock = edf(max_preemptions=0, seconds_per_step=0.0)
    add(sched, req("long-early", steps=8, deadline=1.0), req("short-late", steps=2, deadline=2.0))
    assert sched.schedule().new_ids == ["long-early"]


def test_a_more_pressing_arrival_pauses_a_running_request_that_can_wait():
    sched, clock = edf(max_num_seqs=1)
    add(sched, req("relaxed", steps=6, deadline=100.0))
    tick(sched)
    clock.now += 1
    add(sched, req("urgent", steps=2, deadline=4.0))
    out, _ = tick(sched)
    assert out.preempted_ids == ["relaxed"] and out.new_ids == ["urgent"]
    clock.now += 1
    admitted, ended = run_all(sched, clock)
    assert ended == ["urgent", "relaxed"]


def test_a_request_passed_max_head_bypass_times_goes_first_even_if_hopeless():
    sched, clock = edf(max_head_bypass=2, max_preemptions=0)
    add(sched, req("hopeless", steps=4, deadline=0.5))
    order = []
    for i in range(4):  # a request that can make its deadline arrives every tick
        add(sched, req(f"feasible{i}", steps=1, deadline=clock.now + 10))
        out, _ = tick(sched)
        clock.now += 1
        order += out.new_ids
    order += run_all(sched, clock)[0]
    assert order.index("hopeless") == 2, order


def test_the_measured_rate_is_a_moving_average_of_seconds_per_cost():
    sched, clock = edf(seconds_per_step=0.0)
    add(sched, req("a", steps=4), req("b", steps=4))
    sched.max_num_seqs = 2
    out = sched.schedule()
    sched.observe_tick(2.0, out)  # two requests of cost 1: 1 s per unit
    assert sched.seconds_per_cost == 1.0
    sched.observe_tick(4.0, out)
    assert abs(sched.seconds_per_cost - (0.8 * 1.0 + 0.2 * 2.0)) < 1e-12
    sched.observe_tick(5.0, SchedulerOutput())  # nothing scheduled: nothing learned
    assert abs(sched.seconds_per_cost - 1.2) < 1e-12
