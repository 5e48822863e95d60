"""`scheduling_policy=deadline`: earliest deadline (the end of a request's timeout) first among requests that
can still finish by theirs (at the measured seconds per step), then requests without one, then those that
cannot make it any more; preemption of a running request that is less pressing; the `max_head_bypass` bound
(hand-made runner outputs and a fake clock, no model)."""

from __future__ import annotations

from engine_lib.config import SchedulerConfig
from engine_lib.sched import Scheduler, SchedulerOutput, step_batch_key
from tests.helpers.scheduling import Clock, add, req, tick


def edf(max_num_seqs=1, max_preemptions=1, max_head_bypass=16, seconds_per_step=1.0) -> tuple[Scheduler, Clock]:
    """Every request costs 1 per step, and a step takes `seconds_per_step` per request in it (as if measured)."""
    config = SchedulerConfig(step_execution=True, max_num_seqs=max_num_seqs, max_preemptions=max_preemptions,
                             scheduling_policy="deadline")
    sched = Scheduler(config, lambda p: step_batch_key(p, ("height",)), max_head_bypass=max_head_bypass,
                      cost_fn=lambda p: 1)
    sched.clock = clock = Clock()
    sched.policy.observe_tick(seconds_per_step, 1)
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
    add(sched, req("none-old", steps=2), req("late-deadline", steps=2, timeout_at=100.0),
        req("none-new", steps=2), req("early-deadline", steps=2, timeout_at=50.0))
    assert run_all(sched, clock)[0] == ["early-deadline", "late-deadline", "none-old", "none-new"]


def test_a_request_that_can_no_longer_make_its_deadline_goes_last():
    """`hopeless` needs 4 s of steps but has 3 s: it would be late anyway, and running it first would
    make `tight` (4 s of work, 5 s left) late too."""
    sched, clock = edf(max_preemptions=0)
    add(sched, req("hopeless", steps=4, timeout_at=3.0), req("tight", steps=4, timeout_at=5.0),
        req("no-deadline", steps=1))
    admitted, ended = run_all(sched, clock)
    assert admitted == ["tight", "no-deadline", "hopeless"]
    assert ended.index("tight") == 0


def test_among_hopeless_requests_the_least_work_left_goes_first():
    sched, clock = edf(max_preemptions=0)
    add(sched, req("long", steps=8, timeout_at=1.0), req("short", steps=2, timeout_at=1.0))
    assert run_all(sched, clock)[0] == ["short", "long"]


def test_before_any_tick_is_measured_every_deadline_counts_as_reachable():
    sched, clock = edf(max_preemptions=0, seconds_per_step=0.0)
    add(sched, req("long-early", steps=8, timeout_at=1.0), req("short-late", steps=2, timeout_at=2.0))
    assert sched.schedule().new_ids == ["long-early"]


def test_a_more_pressing_arrival_pauses_a_running_request_that_can_wait():
    sched, clock = edf(max_num_seqs=1)
    add(sched, req("relaxed", steps=6, timeout_at=100.0))
    tick(sched)
    clock.now += 1
    add(sched, req("urgent", steps=2, timeout_at=4.0))
    out, _ = tick(sched)
    assert out.preempted_ids == ["relaxed"] and out.new_ids == ["urgent"]
    clock.now += 1
    admitted, ended = run_all(sched, clock)
    assert ended == ["urgent", "relaxed"]


def test_a_request_passed_max_head_bypass_times_goes_first_even_if_hopeless():
    sched, clock = edf(max_head_bypass=2, max_preemptions=0)
    add(sched, req("hopeless", steps=4, timeout_at=0.5))
    order = []
    for i in range(4):  # a request that can make its deadline arrives every tick
        add(sched, req(f"feasible{i}", steps=1, timeout_at=clock.now + 10))
        out, _ = tick(sched)
        clock.now += 1
        order += out.new_ids
    order += run_all(sched, clock)[0]
    assert order.index("hopeless") == 2, order


def test_each_tick_teaches_the_policy_the_seconds_of_a_step_per_cost():
    sched, clock = edf(seconds_per_step=0.0)
    add(sched, req("a", steps=4), req("b", steps=4))
    sched.max_num_seqs = 2
    out = sched.schedule()
    sched.observe_tick(2.0, out)  # two requests of cost 1
    assert sched.policy.seconds_per_cost == 1.0 and sched.policy.work_left_s(sched.get_request("a"), sched) == 4.0
    sched.observe_tick(5.0, SchedulerOutput())  # nothing scheduled: nothing learned
    assert sched.policy.seconds_per_cost == 1.0


def test_compatible_requests_share_steps_whatever_their_deadlines():
    """The policy orders; it does not keep compatible requests apart (sharing a step is the point of
    batching, and how much it costs depends on the hardware)."""
    sched, clock = edf(max_num_seqs=2)
    add(sched, req("a", steps=4, timeout_at=4.5))
    tick(sched)
    add(sched, req("b", steps=2, timeout_at=20.0))
    assert tick(sched)[0].new_ids == ["b"]
