"""The compute budget (`max_batch_tokens`) in step batching: a request's cost counts its CFG rows, and a
request joins only when the running set's cost plus its own fits (hand-made runner outputs, no model)."""

from __future__ import annotations

from engine_lib.config import SchedulerConfig
from engine_lib.request import DiffusionRequest, SamplingParams
from engine_lib.sched import RunnerOutput, Scheduler, step_batch_key


def cost(params: SamplingParams) -> int:
    """As an adapter's `request_cost`: latent tokens x images x rows (2 with CFG: cond and uncond)."""
    return params["tokens"] * params["num_images"] * (2 if params["cfg"] else 1)


def req(request_id: str, tokens: int, cfg: bool = False, steps: int = 3, num_images: int = 1) -> DiffusionRequest:
    params = SamplingParams({"prompt": request_id, "tokens": tokens, "cfg": cfg, "num_images": num_images,
                             "num_inference_steps": steps})
    return DiffusionRequest(request_id, params)


def budget(max_batch_tokens: int, max_num_seqs: int = 8) -> Scheduler:
    """Every request compatible (an empty key), strict queue order: the budget alone limits the set."""
    config = SchedulerConfig(step_execution=True, max_num_seqs=max_num_seqs, max_batch_tokens=max_batch_tokens,
                             max_preemptions=0)
    return Scheduler(config, lambda p: step_batch_key(p, ()), cost_fn=cost, max_head_bypass=0)


def tick(sched: Scheduler):
    out = sched.schedule()
    progress = {rid: sched.get_request(rid).step_index + 1 for rid in out.scheduled_ids}
    ended = sched.update_from_output(out, RunnerOutput(step_index=progress))
    return out, [r.request_id for r in ended]


def test_a_cfg_request_costs_its_two_rows():
    sched = budget(7)
    for request in (req("plain-3", 3), req("cfg-2", 1, cfg=True), req("cfg-4", 2, cfg=True), req("plain-1", 1)):
        sched.add_request(request)
    assert [sched.cost(i) for i in ("plain-3", "cfg-2", "cfg-4", "plain-1")] == [3, 2, 4, 1]
    out, _ = tick(sched)
    # 3 + 2 = 5; "cfg-4" would make 9 (counted as one row, 7: it would fit); strict order keeps "plain-1" behind
    assert out.new_ids == ["plain-3", "cfg-2"]
    assert sched.num_running == 2 and sched.num_waiting == 2


def test_a_request_joins_only_when_the_running_cost_plus_its_own_fits():
    sched = budget(7)
    sched.add_request(req("a-3", 3, steps=1))
    sched.add_request(req("b-2", 1, cfg=True))
    sched.add_request(req("c-2", 2))
    sched.add_request(req("d-1", 1))
    out, ended = tick(sched)
    assert out.new_ids == ["a-3", "b-2", "c-2"]  # 3 + 2 + 2 = 7, the budget exactly
    assert ended == ["a-3"] and sched.num_waiting == 1  # "d-1" would make 8 (7 without its own cost: it would fit)
    out, _ = tick(sched)
    assert out.new_ids == ["d-1"] and out.running_ids == ["b-2", "c-2"]  # 2 + 2 + 1 = 5 once "a-3" ended


def test_a_joining_request_must_fit_with_its_own_cost_not_only_the_room_left():
    sched = budget(7)
    sched.add_request(req("a-3", 3))
    sched.add_request(req("b-2", 1, cfg=True))
    tick(sched)
    sched.add_request(req("late-3", 3))  # 5 + 3 = 8 > 7
    sched.add_request(req("late-cfg-2", 1, cfg=True))  # 5 + 2 = 7 (strict order: behind "late-3")
    out, _ = tick(sched)
    assert out.new_ids == [] and out.running_ids == ["a-3", "b-2"] and sched.num_waiting == 2


def test_a_cfg_request_that_passes_the_head_still_counts_both_rows():
    config = SchedulerConfig(step_execution=True, max_num_seqs=8, max_batch_tokens=7, max_preemptions=0)
    sched = Scheduler(config, lambda p: step_batch_key(p, ()), cost_fn=cost)  # passing allowed
    sched.add_request(req("a-3", 3))
    sched.add_request(req("b-2", 1, cfg=True))
    tick(sched)  # 5 used
    sched.add_request(req("head-3", 3))  # 8: waits
    sched.add_request(req("cfg-4", 2, cfg=True))  # 9: waits (as one row, 7: it would pass the head)
    sched.add_request(req("plain-2", 2))  # 7: passes the head
    out, _ = tick(sched)
    assert out.new_ids == ["plain-2"] and sched.num_waiting == 2
