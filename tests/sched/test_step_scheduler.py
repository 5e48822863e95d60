"""The scheduler's step batching with hand-made runner outputs (no model): progress, joining, errors, abort."""

from __future__ import annotations

import pytest

from engine_lib.config import SchedulerConfig
from engine_lib.request import DiffusionRequest, PipelineError, RequestStatus, SamplingParams
from engine_lib.sched import RunnerOutput, Scheduler, SchedulerOutput, step_batch_key


def req(request_id: str, steps: int = 3, **overrides) -> DiffusionRequest:
    values = {"prompt": request_id, "height": 64, "num_inference_steps": steps, **overrides}
    return DiffusionRequest(request_id, SamplingParams(values))


def make(max_num_seqs: int = 4) -> Scheduler:
    """Strict queue order (no request passes a waiting one)."""
    return Scheduler(SchedulerConfig(step_execution=True, max_num_seqs=max_num_seqs, max_preemptions=0),
                     lambda p: step_batch_key(p, ("height",)), max_head_bypass=0)


class FakeRunner:
    """Advances every scheduled request one step, as the real runner's tick does."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.prepared: list[str] = []

    def tick(self, out: SchedulerOutput, **extra) -> RunnerOutput:
        self.prepared.extend(out.new_ids)
        progress = {rid: self.sched.get_request(rid).step_index + 1 for rid in out.scheduled_ids}
        return RunnerOutput(step_index=progress, **extra)


def run_tick(sched: Scheduler, runner: FakeRunner):
    out = sched.schedule()
    ended = sched.update_from_output(out, runner.tick(out))
    return out, ended


def test_single_request_lifecycle_over_n_ticks():
    sched = make(1)
    runner = FakeRunner(sched)
    a = req("a", steps=3)
    sched.add_request(a)
    seen = []
    for tick in range(3):
        out = sched.schedule()
        assert out.new_ids == (["a"] if tick == 0 else [])
        assert out.running_ids == ([] if tick == 0 else ["a"])
        assert a.status is RequestStatus.RUNNING
        ended = sched.update_from_output(out, runner.tick(out))
        seen.append(a.step_index)
        assert ended == ([a] if tick == 2 else [])
    assert seen == [1, 2, 3]
    assert a.status is RequestStatus.FINISHED and not sched.has_requests
    out = sched.schedule()
    assert out.is_empty and out.finished_ids == ["a"]


def test_different_step_counts_share_ticks():
    sched = make(4)
    runner = FakeRunner(sched)
    short, long = req("short", steps=2), req("long", steps=4)
    sched.add_request(short)
    sched.add_request(long)
    out, ended = run_tick(sched, runner)
    assert out.new_ids == ["short", "long"] and ended == []
    out, ended = run_tick(sched, runner)
    assert out.running_ids == ["short", "long"] and ended == [short]
    out, ended = run_tick(sched, runner)
    assert out.running_ids == ["long"] and out.finished_ids == ["short"]
    out, ended = run_tick(sched, runner)
    assert ended == [long] and long.step_index == 4


def test_request_admitted_mid_denoise_joins_at_next_tick():
    sched = make(4)
    runner = FakeRunner(sched)
    a = req("a", steps=4)
    sched.add_request(a)
    out = sched.schedule()
    late = req("late", steps=2)
    sched.add_request(late)  # arrives while the tick runs
    sched.update_from_output(out, runner.tick(out))
    assert late.status is RequestStatus.WAITING and late.step_index == 0
    out = sched.schedule()
    assert out.new_ids == ["late"] and out.running_ids == ["a"]
    sched.update_from_output(out, runner.tick(out))
    assert (a.step_index, late.step_index) == (2, 1)
    assert runner.prepared == ["a", "late"]


def test_capacity_limits_running_set_and_waiting_fill_freed_slots():
    sched = make(2)
    runner = FakeRunner(sched)
    for rid, steps in [("a", 1), ("b", 3), ("c", 3)]:
        sched.add_request(req(rid, steps=steps))
    out, ended = run_tick(sched, runner)
    assert out.new_ids == ["a", "b"] and sched.num_waiting == 1 and [r.request_id for r in ended] == ["a"]
    out, _ = run_tick(sched, runner)
    assert out.running_ids == ["b"] and out.new_ids == ["c"]


def test_incompatible_head_blocks_until_running_set_drains():
    sched = make(4)
    runner = FakeRunner(sched)
    sched.add_request(req("a", steps=2, height=64))
    sched.add_request(req("b", steps=1, height=128))
    sched.add_request(req("c", steps=1, height=64))  # compatible with "a", but behind "b"
    out, _ = run_tick(sched, runner)
    assert out.new_ids == ["a"]
    out, _ = run_tick(sched, runner)
    assert out.new_ids == [] and out.running_ids == ["a"]
    out, _ = run_tick(sched, runner)
    assert out.new_ids == ["b"]  # the running set emptied: any key may start it
    out, _ = run_tick(sched, runner)
    assert out.new_ids == ["c"]


def test_start_index_counts_toward_progress():
    sched = make(1)
    runner = FakeRunner(sched)
    a = req("a", steps=3)
    a.step_index = 2
    sched.add_request(a)
    _, ended = run_tick(sched, runner)
    assert ended == [a] and a.step_index == 3


@pytest.mark.parametrize("steps, start", [(0, 0), (-1, 0), (3, -1), (3, 3), (3, 7)])
def test_invalid_step_state_rejected(steps, start):
    sched = make()
    bad = req("bad", steps=steps)
    bad.step_index = start
    with pytest.raises(ValueError, match="bad"):
        sched.add_request(bad)
    assert not sched.has_requests and sched.get_request("bad") is None


def test_duplicate_active_id_rejected():
    sched = make()
    sched.add_request(req("a"))
    sched.schedule()
    with pytest.raises(ValueError, match="already active"):
        sched.add_request(req("a"))


def test_missing_progress_raises():
    sched = make()
    sched.add_request(req("a"))
    sched.add_request(req("b"))
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="b"):
        sched.update_from_output(out, RunnerOutput(step_index={"a": 1}))


def test_progress_going_backwards_raises():
    sched = make()
    a = req("a", steps=4)
    a.step_index = 2
    sched.add_request(a)
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="step 1"):
        sched.update_from_output(out, RunnerOutput(step_index={"a": 1}))


def test_runner_finished_ends_request_before_its_last_step():
    sched = make()
    a = req("a", steps=10)
    sched.add_request(a)
    out = sched.schedule()
    assert sched.update_from_output(out, RunnerOutput(finished={"a"})) == [a]
    assert a.status is RequestStatus.FINISHED


def test_error_fails_only_that_request():
    sched = make()
    runner = FakeRunner(sched)
    a, b = req("a", steps=3), req("b", steps=3)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    error = PipelineError("nan latents")
    ended = sched.update_from_output(out, RunnerOutput(step_index={"b": 1}, errors={"a": error}))
    assert ended == [a] and a.status is RequestStatus.FAILED and a.error is error
    assert b.status is RequestStatus.RUNNING and b.step_index == 1
    out = sched.schedule()
    assert out.running_ids == ["b"] and out.finished_ids == ["a"]
    assert runner.tick(out).step_index == {"b": 2}


def test_abort_mid_run_and_waiting():
    sched = make(1)
    runner = FakeRunner(sched)
    a, b, c = req("a", steps=5), req("b"), req("c")
    for r in (a, b, c):
        sched.add_request(r)
    run_tick(sched, runner)
    out = sched.schedule()  # tick 2 in flight
    assert sched.abort(["a", "c", "nope"]) == [a, c]
    assert a.status is RequestStatus.ABORTED and c.status is RequestStatus.ABORTED
    assert (sched.num_running, sched.num_waiting) == (0, 1)
    assert sched.update_from_output(out, runner_out=RunnerOutput(step_index={"a": 2})) == []
    assert a.status is RequestStatus.ABORTED and a.step_index == 1  # the late result is dropped
    out = sched.schedule()
    assert out.new_ids == ["b"] and sorted(out.finished_ids) == ["a", "c"]
    assert sched.abort(["a"]) == []


def test_compatible_requests_pass_an_incompatible_head_at_most_max_head_bypass_times():
    sched = Scheduler(SchedulerConfig(step_execution=True, max_num_seqs=4, max_preemptions=0),
                      lambda p: step_batch_key(p, ("height",)), max_head_bypass=2)
    runner = FakeRunner(sched)
    sched.add_request(req("run", steps=10))
    run_tick(sched, runner)
    for rid, height in [("head", 128), ("a", 64), ("b", 64), ("c", 64)]:
        sched.add_request(req(rid, steps=10, height=height))
    out, _ = run_tick(sched, runner)
    assert out.new_ids == ["a", "b"], "two compatible requests passed the 128 head, then the bypass budget ran out"
    out, _ = run_tick(sched, runner)
    assert out.new_ids == [] and sched.num_waiting == 2, "c waits behind the head now, though there is room"
    sched.abort(["run", "a", "b"])
    out, _ = run_tick(sched, runner)
    assert out.new_ids == ["head"], "the drained batch takes the head first"


def test_without_bypass_an_incompatible_head_blocks_everyone_behind_it():
    sched = make(4)  # max_head_bypass=0: strict arrival order
    runner = FakeRunner(sched)
    sched.add_request(req("run", steps=10))
    run_tick(sched, runner)
    sched.add_request(req("head", height=128))
    sched.add_request(req("a"))
    out, _ = run_tick(sched, runner)
    assert out.new_ids == [] and sched.num_waiting == 2


# --- decode groups ------------------------------------------------------------------------

def grouping(max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(step_execution=True, max_num_seqs=max_num_seqs, max_preemptions=0),
                     lambda p: step_batch_key(p, ("height",)), group_decodes=True)


def decode_ticks(sched: Scheduler, arrivals: dict[int, list]) -> dict[str, int]:
    """Tick (every scheduled request a step; a denoised one finishes when its decode is not held) until all
    have ended: request id -> the tick it finished. `arrivals`: tick -> requests added before it."""
    finished, tick = {}, 0
    while sched.has_requests or any(t >= tick for t in arrivals):
        for request in arrivals.get(tick, []):
            sched.add_request(request)
        out = sched.schedule()
        progress = {rid: min(sched.get_request(rid).step_index + 1, sched.get_request(rid).num_steps)
                    for rid in out.scheduled_ids}
        decoded = {rid for rid in out.scheduled_ids
                   if progress[rid] == sched.get_request(rid).num_steps and rid not in out.hold_decode_ids}
        for request in sched.update_from_output(out, RunnerOutput(step_index=progress, finished=decoded)):
            finished[request.request_id] = tick
        tick += 1
    return finished


def test_requests_finishing_a_tick_apart_decode_together_within_the_hold():
    sched = grouping()
    assert decode_ticks(sched, {0: [req("r0")], 1: [req("r1")], 2: [req("r2")]}) == {"r0": 4, "r1": 4, "r2": 4}


def test_a_decode_is_not_held_when_no_one_finishes_within_the_hold():
    sched = grouping()
    assert decode_ticks(sched, {0: [req("r0")], 3: [req("r3")]}) == {"r0": 2, "r3": 5}


def test_a_full_decode_group_does_not_wait():
    sched = grouping()
    group = [req(f"g{i}") for i in range(4)]
    assert decode_ticks(sched, {0: group, 1: [req("late")]}) == {**{f"g{i}": 2 for i in range(4)}, "late": 3}


def test_a_more_urgent_request_does_not_wait_for_a_less_urgent_one():
    sched = grouping()
    urgent = DiffusionRequest("urgent", req("urgent").params, priority=1)
    background = DiffusionRequest("background", req("background").params, priority=2)
    assert decode_ticks(sched, {0: [urgent], 1: [background]}) == {"urgent": 2, "background": 3}


def prioritised(request_id: str, priority: int, steps: int = 3) -> DiffusionRequest:
    return DiffusionRequest(request_id, req(request_id, steps).params, priority=priority)


def test_a_less_urgent_request_waits_for_a_more_urgent_one_finishing_within_the_hold():
    """The rule: a denoised decode waits for a running request as urgent as it or more."""
    sched = grouping()
    out_ticks = decode_ticks(sched, {0: [prioritised("background", 2)], 1: [prioritised("urgent", 1)]})
    assert out_ticks == {"background": 3, "urgent": 3}


def test_a_group_denoised_together_waits_only_for_its_most_urgent_level():
    # "urgent" and "background" are done denoising in tick 2; "background-2" finishes in tick 3, "urgent-2" too.
    sched = grouping()
    assert decode_ticks(sched, {0: [prioritised("urgent", 1), prioritised("background", 2)],
                                1: [prioritised("background-2", 2)]}) == {
        "urgent": 2, "background": 2, "background-2": 3}  # no one as urgent as "urgent" finishes: none waits
    sched = grouping()
    assert decode_ticks(sched, {0: [prioritised("urgent", 1), prioritised("background", 2)],
                                1: [prioritised("urgent-2", 1)]}) == {
        "urgent": 3, "background": 3, "urgent-2": 3}  # an equally urgent one does: the whole group waits


def test_mixed_priority_holds_tick_by_tick():
    sched = grouping()
    sched.add_request(prioritised("urgent", 1, steps=2))
    sched.add_request(prioritised("background", 3, steps=2))
    sched.add_request(prioritised("normal", 2, steps=3))
    sched.add_request(prioritised("slow-urgent", 1, steps=5))
    held = []
    for _ in range(6):
        out = sched.schedule()
        held.append(sorted(out.hold_decode_ids))
        progress = {rid: min(sched.get_request(rid).step_index + 1, sched.get_request(rid).num_steps)
                    for rid in out.scheduled_ids}
        decoded = {rid for rid in out.scheduled_ids
                   if progress[rid] == sched.get_request(rid).num_steps and rid not in out.hold_decode_ids}
        sched.update_from_output(out, RunnerOutput(step_index=progress, finished=decoded))
        if not sched.has_requests:
            break
    # tick 1: "urgent" and "background" are denoised; "slow-urgent" (as urgent) needs 3 more ticks, past the
    # hold, and "normal" (finishing next tick) is less urgent than "urgent": nobody waits.
    # tick 2: "normal" is denoised; "slow-urgent" (more urgent) finishes 2 ticks later: within the hold.
    # tick 3: "normal" has waited 1 tick, "slow-urgent" needs 1 more: 2 ticks in all, still within it.
    # tick 4: "normal" and "slow-urgent" decode together.
    assert held == [[], [], ["normal"], ["normal"], []]


def test_request_batching_never_holds_a_decode():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4), lambda p: step_batch_key(p, ("height",)), group_decodes=True)
    sched.add_request(req("a", steps=1))
    assert sched.schedule().hold_decode_ids == set()
