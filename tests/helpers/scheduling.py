"""Hand-made requests, ticks and a clock for the scheduler's tests: the runner's part played without a model."""

from __future__ import annotations

from engine_lib.request import DiffusionRequest, SamplingParams
from engine_lib.sched import RunnerOutput

_clock = iter(range(1, 10**6))


def req(request_id: str, priority: int = 2, steps: int = 4, height: int = 64, timeout_at=None) -> DiffusionRequest:
    """A request of `steps` steps at `height`, arriving after every one made before it."""
    params = SamplingParams({"prompt": request_id, "height": height, "num_inference_steps": steps})
    return DiffusionRequest(request_id, params, arrival_time=float(next(_clock)), priority=priority,
                            timeout_at=timeout_at)


def tick(sched):
    """One tick: every scheduled request advances a step."""
    out = sched.schedule()
    progress = {rid: sched.get_request(rid).step_index + 1 for rid in out.scheduled_ids}
    ended = sched.update_from_output(out, RunnerOutput(step_index=progress))
    return out, [r.request_id for r in ended]


def admission_order(sched) -> list[str]:
    """Tick until every request has ended; the ids in the order they were admitted."""
    order = []
    while sched.has_requests:
        out, _ = tick(sched)
        order += out.new_ids
    return order


def add(sched, *requests):
    """Hand `requests` to the scheduler, in order."""
    for request in requests:
        sched.add_request(request)


class Clock:
    """A scheduler's clock that the test moves by hand (`clock.now`)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
