"""Priorities, preemption at step boundaries, timeouts and the compute budget in the scheduler
(hand-made runner outputs, no model)."""

from __future__ import annotations

import pytest

from engine_lib.config import SchedulerConfig
from engine_lib.request import RequestStatus, RequestTimedOutError
from engine_lib.sched import Scheduler, step_batch_key
from engine_lib.sched.keys import request_batch_key
from tests.helpers.scheduling import add, admission_order, req, tick


def step(max_num_seqs=2, max_preemptions=1, max_batch_tokens=0, max_head_bypass=16) -> Scheduler:
    config = SchedulerConfig(step_execution=True, max_num_seqs=max_num_seqs, max_batch_tokens=max_batch_tokens,
                             max_preemptions=max_preemptions)
    return Scheduler(config, lambda p: step_batch_key(p, ("height",)), max_head_bypass=max_head_bypass,
                     cost_fn=lambda p: p["height"])


def test_the_most_urgent_waiting_request_is_admitted_first_then_the_oldest():
    sched = step(max_num_seqs=1, max_preemptions=0)
    add(sched, req("low", 3), req("mid-old", 2), req("urgent", 1), req("mid-new", 2))
    assert admission_order(sched) == ["urgent", "mid-old", "mid-new", "low"]
    assert sched.waiting_by_priority() == {}


def test_an_urgent_request_preempts_the_least_urgent_latest_running_one_which_resumes_later():
    sched = step(max_num_seqs=2)
    a, b = req("bg-a", 3), req("bg-b", 3)
    add(sched, a, b)
    tick(sched)  # both run a step
    urgent = req("urgent", 1, steps=2)
    add(sched, urgent)
    out, _ = tick(sched)
    assert out.preempted_ids == ["bg-b"] and out.new_ids == ["urgent"] and out.running_ids == ["bg-a"]
    assert b.status is RequestStatus.WAITING and b.step_index == 1 and b.num_preemptions == 1
    assert sched.waiting_by_priority() == {3: 1} and sched.num_preempted == 1
    _, ended = tick(sched)
    assert ended == ["urgent"]
    out, _ = tick(sched)  # bg-b resumes where it stopped: not new (the runner still holds its state)
    assert out.running_ids == ["bg-a", "bg-b"] and out.new_ids == [] and b.step_index == 2


def test_a_request_is_preempted_at_most_max_preemptions_times():
    sched = step(max_num_seqs=1, max_preemptions=1)
    bg = req("bg", 3, steps=10)
    add(sched, bg)
    tick(sched)
    add(sched, req("u1", 1, steps=1))
    out, _ = tick(sched)
    assert out.preempted_ids == ["bg"]
    tick(sched)  # bg resumes
    add(sched, req("u2", 1, steps=1))
    out, _ = tick(sched)
    assert out.preempted_ids == [] and out.running_ids == ["bg"]  # its one preemption is spent


def test_equal_priorities_never_preempt_and_zero_disables_preemption():
    for sched, urgent_priority in ((step(max_num_seqs=1), 3), (step(max_num_seqs=1, max_preemptions=0), 1)):
        add(sched, req("bg", 3))
        tick(sched)
        add(sched, req("next", urgent_priority))
        out, _ = tick(sched)
        assert out.preempted_ids == [] and out.running_ids == ["bg"]


def test_an_incompatible_urgent_request_pauses_the_whole_set_only_if_all_of_it_is_less_urgent():
    sched = step(max_num_seqs=2)
    add(sched, req("bg", 3), req("peer", 1))
    tick(sched)
    add(sched, req("urgent-128", 1, height=128))
    out, _ = tick(sched)
    assert out.preempted_ids == []  # "peer" is as urgent: nobody pauses, the head waits
    sched2 = step(max_num_seqs=2)
    add(sched2, req("bg1", 3), req("bg2", 2))
    tick(sched2)
    add(sched2, req("urgent-128", 1, height=128))
    out, _ = tick(sched2)
    assert sorted(out.preempted_ids) == ["bg1", "bg2"] and out.new_ids == ["urgent-128"] and out.running_ids == []


def test_a_less_urgent_request_never_passes_a_more_urgent_head():
    sched = step(max_num_seqs=4, max_preemptions=0)
    add(sched, req("running", 2))
    tick(sched)
    add(sched, req("urgent-128", 1, height=128), req("low-64", 3), req("peer-64", 2))
    out, _ = tick(sched)
    assert out.new_ids == []  # both compatible ones are less urgent than the blocked head


def test_the_compute_budget_limits_the_running_set_and_a_big_request_runs_alone():
    sched = step(max_num_seqs=4, max_preemptions=0, max_batch_tokens=128)  # cost = height
    add(sched, req("a"), req("b"), req("c"))
    out, _ = tick(sched)
    assert out.new_ids == ["a", "b"]  # 64 + 64; "c" would make 192
    sched = step(max_num_seqs=4, max_preemptions=0, max_batch_tokens=100)
    add(sched, req("big", height=128))
    out, _ = tick(sched)
    assert out.new_ids == ["big"]  # alone it always runs (the engine refuses it at admission instead)


def test_preemption_frees_budget_as_well_as_seats():
    sched = step(max_num_seqs=4, max_batch_tokens=128)
    add(sched, req("bg1", 3), req("bg2", 3))
    tick(sched)
    add(sched, req("urgent", 1))
    out, _ = tick(sched)
    assert out.preempted_ids == ["bg2"] and out.new_ids == ["urgent"]


def test_request_mode_waves_follow_priority_and_the_budget():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_batch_tokens=128),
                      lambda p: request_batch_key(p, ("height",)), cost_fn=lambda p: p["height"])
    add(sched, req("low1", 3), req("urgent1", 1), req("urgent2", 1), req("urgent3", 1))
    out, _ = tick(sched)
    assert out.new_ids == ["urgent1", "urgent2"]  # the budget takes two of 64


def test_a_request_whose_timeout_runs_out_before_it_starts_times_out_and_a_started_one_does_not():
    sched = step(max_num_seqs=1, max_preemptions=1)
    running = req("running", 3, timeout_at=5.0)
    add(sched, running)
    tick(sched)
    late, on_time = req("late", 3, timeout_at=10.0), req("on-time", 3, timeout_at=100.0)
    add(sched, late, on_time)
    add(sched, req("urgent", 1))
    tick(sched)  # "running" is paused: it started, so its timeout no longer applies
    expired = sched.expire(now=50.0)
    assert expired == [late] and late.status is RequestStatus.FAILED
    assert isinstance(late.error, RequestTimedOutError) and "timed out" in str(late.error)
    assert sched.get_request("late") is None and sched.get_request("running") is running
    out = sched.schedule()
    assert "late" in out.finished_ids


@pytest.mark.parametrize("max_preemptions", [-1])
def test_negative_preemption_bound_is_refused(max_preemptions):
    with pytest.raises(ValueError, match="max_preemptions"):
        step(max_preemptions=max_preemptions)


def separate(max_num_seqs=4, max_preemptions=1) -> Scheduler:
    config = SchedulerConfig(step_execution=True, max_num_seqs=max_num_seqs, max_preemptions=max_preemptions,
                             scheduling_policy="separate_priorities")
    return Scheduler(config, lambda p: step_batch_key(p, ("height",)))


def test_separate_priorities_an_urgent_request_pauses_the_whole_less_urgent_set_and_runs_alone():
    sched = separate()
    add(sched, req("bg1", 3, steps=6), req("bg2", 3, steps=6), req("mid", 2, steps=6))
    out, _ = tick(sched)
    assert out.new_ids == ["mid"]  # one level per batch: the priority-3 requests wait for it
    for _ in range(5):  # "mid" runs its other five steps alone
        tick(sched)
    out, _ = tick(sched)
    assert out.new_ids == ["bg1", "bg2"]
    add(sched, req("urgent", 1, steps=2), req("bg3", 3))
    out, _ = tick(sched)
    assert sorted(out.preempted_ids) == ["bg1", "bg2"] and out.new_ids == ["urgent"] and out.running_ids == []
    _, ended = tick(sched)  # "bg3" (a free seat, another level) does not join the urgent one
    assert ended == ["urgent"]
    out, _ = tick(sched)
    assert out.running_ids == ["bg1", "bg2"] and out.new_ids == ["bg3"]


def test_separate_priorities_an_urgent_head_waits_for_the_set_to_drain_when_it_cannot_pause_it():
    sched = separate(max_num_seqs=4, max_preemptions=0)
    add(sched, req("bg", 3, steps=3))
    tick(sched)
    add(sched, req("urgent", 1, steps=1), req("bg-late", 3))
    assert admission_order(sched) == ["urgent", "bg-late"]  # nothing joined "bg" past the urgent head
