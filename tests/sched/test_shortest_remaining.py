"""`scheduling_policy=shortest_remaining` in the scheduler: fewest steps left first within a priority level,
preemption of the running request with the most steps left, and the `max_head_bypass` bound that keeps a
long request from starving (hand-made runner outputs, no model)."""

from __future__ import annotations

import pytest

from engine_lib.config import SchedulerConfig
from engine_lib.sched import Scheduler, step_batch_key
from engine_lib.sched.keys import request_batch_key
from tests.helpers.scheduling import add, admission_order, req, tick


def srpt(max_num_seqs=1, max_preemptions=1, max_head_bypass=16, order="shortest_remaining") -> Scheduler:
    config = SchedulerConfig(step_execution=True, max_num_seqs=max_num_seqs, max_preemptions=max_preemptions,
                             scheduling_policy=order)
    return Scheduler(config, lambda p: step_batch_key(p, ("height",)), max_head_bypass=max_head_bypass)


def test_the_waiting_request_with_fewest_steps_left_goes_first_then_the_oldest():
    sched = srpt(max_preemptions=0)
    add(sched, req("long", steps=16), req("mid", steps=8), req("short-old", steps=4), req("short-new", steps=4))
    assert admission_order(sched) == ["short-old", "short-new", "mid", "long"]


def test_arrival_order_is_unchanged_by_step_counts():
    sched = srpt(max_preemptions=0, order="arrival")
    add(sched, req("long", steps=16), req("mid", steps=8), req("short", steps=4))
    assert admission_order(sched) == ["long", "mid", "short"]


def test_priority_still_comes_before_steps_left():
    sched = srpt(max_preemptions=0)
    add(sched, req("short-low", priority=3, steps=2), req("long-urgent", priority=1, steps=16))
    assert admission_order(sched) == ["long-urgent", "short-low"]


def test_a_shorter_arrival_pauses_the_running_request_with_the_most_steps_left_which_resumes_later():
    sched = srpt(max_num_seqs=2)
    long, mid = req("long", steps=16), req("mid", steps=8)
    add(sched, long, mid)
    tick(sched)
    add(sched, req("short", steps=2))
    out, _ = tick(sched)
    assert out.preempted_ids == ["long"] and out.new_ids == ["short"] and out.running_ids == ["mid"]
    assert long.step_index == 1 and long.num_preemptions == 1
    ended = []
    while sched.has_requests:
        ended += tick(sched)[1]
    assert ended == ["short", "mid", "long"]


def test_a_request_with_as_many_steps_left_is_not_paused():
    sched = srpt(max_num_seqs=1)
    add(sched, req("first", steps=5))
    tick(sched)  # 4 left
    add(sched, req("second", steps=4))
    out, _ = tick(sched)
    assert out.preempted_ids == [] and out.running_ids == ["first"]


def test_shorter_requests_pass_a_long_one_at_most_max_head_bypass_times():
    sched = srpt(max_head_bypass=2, max_preemptions=0)
    add(sched, req("long", steps=8))
    order = []
    for i in range(4):  # a short request arrives every tick: without the bound, long would never run
        add(sched, req(f"short{i}", steps=1))
        out, _ = tick(sched)
        order += out.new_ids
    order += admission_order(sched)
    assert order.index("long") == 2, order  # passed by short0 and short1, then first


def test_max_head_bypass_0_is_arrival_order():
    sched = srpt(max_head_bypass=0, max_preemptions=0)
    add(sched, req("long", steps=16), req("short", steps=4))
    assert admission_order(sched) == ["long", "short"]


def test_request_mode_admits_the_shortest_wave_first():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, scheduling_policy="shortest_remaining"),
                      lambda p: request_batch_key(p, ("height",)))
    add(sched, req("long", steps=16), req("short-a", steps=4), req("short-b", steps=4))
    out = sched.schedule()
    assert out.new_ids == ["short-a", "short-b"]


@pytest.mark.parametrize("value", ["srpt", "", "Shortest_Remaining"])
def test_an_unknown_policy_is_refused(value):  # the engine's parameter: tests/engine/test_engine.py
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        srpt(order=value)
