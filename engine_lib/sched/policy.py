"""Scheduling policies: who goes first, who may share a step, who may be paused for whom.

The scheduler (`scheduler.py`) is the mechanism: queue, running set, keys,
budget, abort, expiry, progress. A policy only answers three questions, and a
deployer picks one by name (`scheduling_policy`, docs/architecture.md):

* `rank(request, starved, view)`: its place within its priority level
  (smaller first; ties go to the oldest). `starved` is true once the
  scheduler's bound of later requests have passed it: it must then go first.
* `can_share(request, other)`: whether two requests of one compatibility key
  may share a forward (a policy may keep them apart).
* `may_preempt(victim, head, urgency)`: whether a running request may pause
  between two steps so that the waiting `head` can run.

Every policy orders by the `priority` input first (1 most urgent), as
Triton's own priority levels do.
"""

from __future__ import annotations

from typing import Callable, Protocol

from engine_lib.request import DiffusionRequest


class SchedulerView(Protocol):
    """What a policy may read of the scheduler."""

    def clock(self) -> float: ...

    def cost(self, request_id: str) -> int: ...


class SchedulingPolicy:
    """Oldest first within a priority level; any compatible requests share a step; a running request
    pauses only for a more urgent one. The default."""

    name = "arrival"

    def rank(self, request: DiffusionRequest, starved: bool, view: SchedulerView) -> tuple:
        return ()

    def can_share(self, request: DiffusionRequest, other: DiffusionRequest) -> bool:
        return True

    def may_preempt(self, victim: DiffusionRequest, head: DiffusionRequest,
                    urgency: Callable[[DiffusionRequest], tuple]) -> bool:
        return urgency(victim) > urgency(head)

    def observe_tick(self, seconds: float, cost: int) -> None:
        """A tick carrying `cost` (latent tokens x rows) took `seconds`."""


class ShortestRemainingPolicy(SchedulingPolicy):
    """Fewest denoise steps left first (a starved request counts as having none): the shortest mean
    latency when step counts differ; a request with fewer steps left also pauses one with more."""

    name = "shortest_remaining"

    def rank(self, request: DiffusionRequest, starved: bool, view: SchedulerView) -> tuple:
        return (0 if starved else request.num_steps - request.step_index,)


class DeadlinePolicy(SchedulingPolicy):
    """Earliest deadline first among requests that can still finish by theirs, then requests without one
    (oldest first), then those that cannot make it any more (least work left first: they are late
    anyway, and running them first would make others late too).

    A request's deadline is the end of its timeout (`DiffusionRequest.timeout_at`); the engine only
    enforces that it starts before then, this policy tries to finish it before then. "Can finish":
    now plus its steps left, each at the measured seconds of a step of its cost, is not past it.
    """

    name = "deadline"

    def __init__(self, smoothing: float = 0.2):
        self.smoothing = smoothing
        self.seconds_per_cost = 0.0  # 0 before the first tick: every deadline counts as reachable

    def observe_tick(self, seconds: float, cost: int) -> None:
        if cost > 0 and seconds > 0:
            sample = seconds / cost
            self.seconds_per_cost = sample if not self.seconds_per_cost else (
                (1 - self.smoothing) * self.seconds_per_cost + self.smoothing * sample)

    def work_left_s(self, request: DiffusionRequest, view: SchedulerView) -> float:
        steps_left = request.num_steps - request.step_index
        return steps_left * self.seconds_per_cost * view.cost(request.request_id)

    def rank(self, request: DiffusionRequest, starved: bool, view: SchedulerView) -> tuple:
        if starved:
            return -1, request.arrival_time
        if request.timeout_at is None:
            return 1, request.arrival_time
        work = self.work_left_s(request, view)
        if view.clock() + work <= request.timeout_at:
            return 0, request.timeout_at
        return 2, work


class SeparatePrioritiesPolicy(SchedulingPolicy):
    """Oldest first, and a forward holds one priority level only: a more urgent request pauses the whole
    less urgent running set (or waits for it to drain) and runs without it, so it gets its solo
    step time where a bigger batch makes each step slower."""

    name = "separate_priorities"

    def can_share(self, request: DiffusionRequest, other: DiffusionRequest) -> bool:
        return request.priority == other.priority


POLICIES: dict[str, type[SchedulingPolicy]] = {
    cls.name: cls for cls in (SchedulingPolicy, ShortestRemainingPolicy, DeadlinePolicy, SeparatePrioritiesPolicy)}


def make_policy(name: str) -> SchedulingPolicy:
    """The policy called `name` (ValueError naming the known ones)."""
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name]()
