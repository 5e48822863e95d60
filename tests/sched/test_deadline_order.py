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
    """Every request costs 1 per step, and a step takes `seconds_per_step` per request in it (as if measured
    on ticks of one request: the fixed part of a step still unknown)."""
    sched = StepScheduler(max_num_seqs, lambda p: step_batch_key(p, ("height",)), max_head_bypass,
                          cost_fn=lambda p: 1, max_preemptions=max_preemptions, admission_order="deadline")
    sched.clock = clock = Clock()
    sched.tick_time.observe(1, seconds_per_step)
    return sched, clock


def measured(sched, fixed_s: float, per_request_s: float) -> None:
    """Ticks of one and of two requests measured: a step costs fixed_s plus per_request_s per request."""
    for _ in range(4):
        for rows in (1, 2):
            sched.tick_time.observe(rows, fixed_s + per_request_s * rows)


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


def test_each_tick_teaches_the_tick_time_its_cost_and_seconds():
    sched, clock = edf(seconds_per_step=0.0)
    add(sched, req("a", steps=4), req("b", steps=4))
    sched.max_num_seqs = 2
    out = sched.schedule()
    sched.observe_tick(2.0, out)  # two requests of cost 1
    assert sched.tick_time.seconds(2) == 2.0 and sched.work_left_s(sched.get_request("a")) == 4.0
    sched.observe_tick(5.0, SchedulerOutput())  # nothing scheduled: nothing learned
    assert sched.tick_time.seconds(2) == 2.0


def test_a_request_joins_the_running_set_when_sharing_steps_keeps_every_deadline():
    """A step of two costs 1.2 s, of one 1 s: `a` (4 steps, deadline 10 s) still makes it sharing with `b`."""
    sched, clock = edf(max_num_seqs=2, seconds_per_step=0.0)
    measured(sched, fixed_s=0.8, per_request_s=0.2)
    add(sched, req("a", steps=4, deadline=10.0))
    tick(sched)
    add(sched, req("b", steps=4, deadline=20.0))
    assert tick(sched)[0].new_ids == ["b"]


def test_a_request_waits_when_sharing_steps_would_make_a_running_one_late():
    """`a` needs 4 steps and has 4.5 s: alone (1 s a step) it makes it; had `b` joined for its last three
    steps (1.2 s each) it would end at 4.6 s. `b` joins for a's last two, which still end `a` in time."""
    sched, clock = edf(max_num_seqs=2, seconds_per_step=0.0)
    measured(sched, fixed_s=0.8, per_request_s=0.2)
    add(sched, req("a", steps=4, deadline=4.5))
    shared, ended_at = [], {}
    while sched.has_requests:
        out, done = tick(sched)
        clock.now += sched.tick_time.seconds(len(out.scheduled_ids))
        shared.append(len(out.scheduled_ids) == 2)
        ended_at.update({rid: clock.now for rid in done})
        if len(shared) == 1:
            add(sched, req("b", steps=2, deadline=20.0))
    assert shared == [False, False, True, True] and ended_at["a"] <= 4.5, (shared, ended_at)


def test_a_request_waits_when_a_shared_step_costs_as_much_as_two():
    """Steps cost in proportion to their requests (no fixed part): sharing saves nothing, and would only
    make the first request finish later."""
    sched, clock = edf(max_num_seqs=2, seconds_per_step=0.0)
    measured(sched, fixed_s=0.0, per_request_s=1.0)
    add(sched, req("a", steps=2, deadline=100.0))
    tick(sched)
    add(sched, req("b", steps=2, deadline=100.0))
    assert tick(sched)[0].new_ids == []


def test_before_two_costs_are_measured_requests_share_steps_to_measure_them():
    sched, clock = edf(max_num_seqs=2)  # only ticks of one request seen: the fixed part is unknown
    add(sched, req("a", steps=2, deadline=100.0))
    tick(sched)
    add(sched, req("b", steps=2, deadline=100.0))
    assert tick(sched)[0].new_ids == ["b"]
