"""The scheduler's request batching with hand-made runner outputs (no model), and the admission wait.

A wave is admitted when nothing runs and then advances one denoise step per tick
(the runner's one loop); nothing joins it until every member has ended.
"""

from __future__ import annotations

import pytest

from engine_lib.config import SchedulerConfig
from engine_lib.request import DiffusionRequest, PipelineError, RequestStatus, SamplingParams
from engine_lib.sched import RunnerOutput, Scheduler, request_batch_key
from tests.helpers.scheduling import Clock


def req(request_id: str, **overrides) -> DiffusionRequest:
    values = {"prompt": f"prompt {request_id}", "height": 64, "seed": 0, "num_inference_steps": 4, **overrides}
    return DiffusionRequest(request_id, SamplingParams(values))


def finish_all(sched_out) -> RunnerOutput:
    return RunnerOutput(finished=set(sched_out.scheduled_ids))


def one_step(sched: Scheduler, sched_out) -> RunnerOutput:
    """What the runner reports after one denoise step of every scheduled request."""
    return RunnerOutput(step_index={rid: sched.get_request(rid).step_index + 1 for rid in sched_out.scheduled_ids})


def key(params):
    return request_batch_key(params, ("height",))


def make(max_num_seqs: int = 1) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs), key)


def test_rejects_capacity_below_one():
    with pytest.raises(ValueError):
        Scheduler(SchedulerConfig(max_num_seqs=0), key)


def test_single_request_lifecycle():
    sched = make()
    a = req("a")
    sched.add_request(a)
    assert (sched.num_waiting, sched.num_running, a.status) == (1, 0, RequestStatus.WAITING)
    assert sched.get_request("a") is a

    out = sched.schedule()
    assert (out.new_ids, out.running_ids, out.finished_ids) == (["a"], [], [])
    assert (sched.num_waiting, sched.num_running, a.status) == (0, 1, RequestStatus.RUNNING)

    ended = sched.update_from_output(out, finish_all(out))
    assert ended == [a] and a.status is RequestStatus.FINISHED and a.error is None
    assert (sched.num_waiting, sched.num_running, sched.has_requests) == (0, 0, False)
    assert sched.get_request("a") is None

    nxt = sched.schedule()
    assert nxt.is_empty and nxt.finished_ids == ["a"]  # reported once, so the runner can free state
    assert sched.schedule().finished_ids == []


def test_fifo_with_capacity_one():
    sched = make(1)
    for rid in "abc":
        sched.add_request(req(rid))
    order = []
    while sched.has_requests:
        out = sched.schedule()
        order.extend(out.new_ids)
        assert len(out.new_ids) == 1
        sched.update_from_output(out, finish_all(out))
    assert order == ["a", "b", "c"]


def test_compatible_requests_batched_up_to_max_num_seqs():
    sched = make(3)
    for i in range(5):
        sched.add_request(req(f"r{i}", seed=i))  # seeds differ: still compatible
    out = sched.schedule()
    assert out.new_ids == ["r0", "r1", "r2"]
    assert (sched.num_running, sched.num_waiting) == (3, 2)
    sched.update_from_output(out, finish_all(out))
    out = sched.schedule()
    assert out.new_ids == ["r3", "r4"]


def test_incompatible_head_blocks_later_compatible():
    sched = make(4)
    sched.add_request(req("a", height=64))
    sched.add_request(req("b", height=128))
    sched.add_request(req("c", height=64))  # compatible with "a" but behind "b"
    waves = []
    while sched.has_requests:
        out = sched.schedule()
        waves.append(out.new_ids)
        sched.update_from_output(out, finish_all(out))
    assert waves == [["a"], ["b"], ["c"]]


def test_different_step_counts_do_not_share_a_wave():
    sched = make(4)
    sched.add_request(req("a", num_inference_steps=4))
    sched.add_request(req("b", num_inference_steps=8))
    assert sched.schedule().new_ids == ["a"]


def test_a_wave_advances_step_by_step_and_nothing_joins_it():
    sched = make(3)
    sched.add_request(req("a", num_inference_steps=3))
    sched.add_request(req("b", num_inference_steps=3))
    out = sched.schedule()
    assert (out.new_ids, out.running_ids) == (["a", "b"], [])
    sched.add_request(req("c", num_inference_steps=3))  # compatible, and there is room: it still waits
    for tick in range(3):
        if tick:
            out = sched.schedule()
            assert (out.new_ids, out.running_ids) == ([], ["a", "b"])
        ended = sched.update_from_output(out, one_step(sched, out))
        assert [r.request_id for r in ended] == ([] if tick < 2 else ["a", "b"])
    assert [r.status for r in ended] == [RequestStatus.FINISHED] * 2
    assert sched.schedule().new_ids == ["c"]


def test_a_failed_member_ends_alone_and_the_wave_goes_on():
    sched = make(2)
    a, b = req("a", num_inference_steps=2), req("b", num_inference_steps=2)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    ended = sched.update_from_output(out, RunnerOutput(step_index={"b": 1}, errors={"a": PipelineError("boom")}))
    assert ended == [a] and a.status is RequestStatus.FAILED
    out = sched.schedule()
    assert (out.new_ids, out.running_ids) == ([], ["b"])
    assert sched.update_from_output(out, one_step(sched, out)) == [b] and b.status is RequestStatus.FINISHED


def test_duplicate_active_id_rejected_and_reusable_after_end():
    sched = make()
    sched.add_request(req("a"))
    with pytest.raises(ValueError, match="already active"):
        sched.add_request(req("a"))
    out = sched.schedule()
    with pytest.raises(ValueError, match="already active"):
        sched.add_request(req("a"))
    sched.update_from_output(out, finish_all(out))
    sched.add_request(req("a"))  # the old one ended: the id is free again
    assert sched.num_waiting == 1


def test_abort_waiting_request():
    sched = make(2)
    a, b = req("a"), req("b")
    sched.add_request(a)
    sched.add_request(b)
    assert sched.abort(["a", "unknown"]) == [a]
    assert a.status is RequestStatus.ABORTED and sched.get_request("a") is None
    out = sched.schedule()
    assert out.new_ids == ["b"] and out.finished_ids == ["a"]
    assert sched.abort(["a"]) == []  # already ended: ignored


def test_abort_running_request_drops_its_result_and_keeps_batch_mates():
    sched = make(2)
    a, b = req("a"), req("b")
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert sched.abort(["a"]) == [a]
    assert a.status is RequestStatus.ABORTED and sched.num_running == 1
    ended = sched.update_from_output(out, finish_all(out))
    assert ended == [b] and b.status is RequestStatus.FINISHED
    assert a.status is RequestStatus.ABORTED  # the late result does not revive it
    assert sorted(sched.schedule().finished_ids) == ["a", "b"]


def test_aborting_the_whole_wave_drops_its_late_results_and_lets_the_next_wave_in():
    sched = make(1)
    sched.add_request(req("a"))
    sched.add_request(req("b"))
    out = sched.schedule()
    sched.abort(["a"])
    assert sched.update_from_output(out, RunnerOutput()) == []  # the tick that was in flight: dropped
    nxt = sched.schedule()
    assert nxt.new_ids == ["b"] and nxt.finished_ids == ["a"]


def test_error_output_marks_only_that_request_failed():
    sched = make(2)
    a, b = req("a"), req("b")
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    error = PipelineError("boom")
    ended = sched.update_from_output(out, RunnerOutput(finished={"b"}, errors={"a": error}))
    assert ended == [a, b]
    assert a.status is RequestStatus.FAILED and a.error is error
    assert b.status is RequestStatus.FINISHED and b.error is None


def test_scheduled_request_without_result_is_an_internal_error():
    sched = make(2)
    sched.add_request(req("a"))
    sched.add_request(req("b"))
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="b"):
        sched.update_from_output(out, RunnerOutput(finished={"a"}))
    with pytest.raises(RuntimeError, match="step 9"):
        sched.update_from_output(out, RunnerOutput(step_index={"a": 9, "b": 1}))


# --- admission wait ---------------------------------------------------------------------

def waiting_wave(max_num_seqs: int = 4, wait_s: float = 10.0) -> tuple[Scheduler, Clock]:
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, request_batch_max_wait_ms=wait_s * 1000), key)
    sched.clock = clock = Clock()
    return sched, clock


def test_admission_wait_admits_at_once_when_a_full_wave_waits():
    sched, clock = waiting_wave(max_num_seqs=2)
    sched.add_request(req("a"))
    sched.add_request(req("b"))
    out = sched.schedule()
    assert out.new_ids == ["a", "b"] and out.retry_after_s == 0


def test_admission_wait_holds_a_growing_burst_until_it_is_stable_for_the_window():
    sched, clock = waiting_wave(wait_s=10.0)  # the window: 50 ms (the wait's end is 10 s away)
    sched.add_request(req("a"))
    out = sched.schedule()
    assert out.is_empty and out.retry_after_s == pytest.approx(0.05)
    clock.now = 0.03
    sched.add_request(req("b"))  # the burst grows: the window starts again
    out = sched.schedule()
    assert out.is_empty and out.retry_after_s == pytest.approx(0.05)
    clock.now = 0.08
    assert sched.schedule().new_ids == ["a", "b"]


def test_admission_wait_window_is_a_fifth_of_a_short_wait():
    sched, clock = waiting_wave(wait_s=0.1)
    sched.add_request(req("a"))
    assert sched.schedule().retry_after_s == pytest.approx(0.02)
    clock.now = 0.02
    assert sched.schedule().new_ids == ["a"]


def test_admission_wait_ends_at_its_limit_while_arrivals_continue():
    sched, clock = waiting_wave(max_num_seqs=1000, wait_s=0.2)
    waits = []
    for i in range(100):
        sched.add_request(req(f"r{i}"))
        out = sched.schedule()
        if out.new_ids:
            break
        waits.append(out.retry_after_s)
        clock.now += 0.01  # an arrival every 10 ms
    assert clock.now == pytest.approx(0.2) and len(out.new_ids) == 21 and max(waits) <= 0.05 + 1e-9


def test_admission_wait_starts_afresh_after_the_queue_empties():
    sched, clock = waiting_wave(wait_s=0.2)
    sched.add_request(req("a"))
    sched.schedule()
    sched.abort(["a"])
    sched.schedule()
    clock.now = 5.0  # long after the first burst's wait would have ended
    sched.add_request(req("b"))
    out = sched.schedule()
    assert out.is_empty and out.retry_after_s > 0


def test_step_batching_never_waits_for_a_burst():
    sched = Scheduler(SchedulerConfig(step_execution=True, max_num_seqs=4, request_batch_max_wait_ms=10000.0), key)
    sched.add_request(req("a"))
    assert sched.schedule().new_ids == ["a"]
