"""What the schedulers exchange with the engine: pure Python, request ids only, no tensors."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Optional

from engine_lib.request import DiffusionRequest, EngineError, RequestStatus, RequestTimedOutError, SamplingParams
from engine_lib.sched.tick_time import TickTimeModel

ADMISSION_ORDERS = ("arrival", "shortest_remaining", "deadline")
KeyFn = Callable[[SamplingParams], Hashable]
CostFn = Callable[[SamplingParams], int]  # latent tokens x rows a request adds to one forward


@dataclass
class SchedulerOutput:
    """One tick's plan.

    new_ids: admitted this tick (the runner must `prepare_encode` them).
    running_ids: admitted earlier and scheduled again this tick (a paused request
        that resumes is one of them: the runner still holds its state).
    finished_ids: requests that ended since the last tick (finished, failed or
        aborted); the runner frees any state it still holds for them.
    """

    new_ids: list[str] = field(default_factory=list)
    running_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)  # paused this tick; the runner keeps their state

    @property
    def scheduled_ids(self) -> list[str]:
        return self.new_ids + self.running_ids

    @property
    def is_empty(self) -> bool:
        return not self.new_ids and not self.running_ids


@dataclass
class RunnerOutput:
    """What the runner reports back for one tick.

    step_index: each scheduled request's progress after this tick.
    finished: requests whose final result the runner produced this tick.
    errors: requests that failed this tick (they end alone; batch-mates go on).
    decoding: requests done denoising whose decode waits for others' (they stay running a tick or two).
    """

    step_index: dict[str, int] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    errors: dict[str, EngineError] = field(default_factory=dict)
    decoding: set[str] = field(default_factory=set)


class Scheduler(ABC):
    """Admission by urgency into a running set that shares one compatibility key; one denoise step per tick.

    Everything both modes share lives here: the waiting queue (`_queue_order`),
    the running set, each active request's key and cost, the compute budget
    (`max_batch_tokens`: the running set's latent tokens x rows; 0: no limit; a
    request alone is never refused by it), deadlines, abort, progress updates
    and the ids that ended since the last tick. Subclasses decide only who is
    admitted when (`schedule`). Not thread-safe: the engine calls it under its
    lock. Only a scheduler writes request status.
    """

    def __init__(self, max_num_seqs: int, key_fn: KeyFn, cost_fn: Optional[CostFn] = None, max_batch_tokens: int = 0,
                 max_head_bypass: int = 0, admission_order: str = "arrival"):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_head_bypass < 0:
            raise ValueError(f"max_head_bypass must be >= 0, got {max_head_bypass}")
        if admission_order not in ADMISSION_ORDERS:
            raise ValueError(f"admission_order must be one of {', '.join(ADMISSION_ORDERS)}, got {admission_order!r}")
        self.max_num_seqs = max_num_seqs
        self.max_head_bypass = max_head_bypass  # how many later requests may pass a waiting one
        self.admission_order = admission_order
        self.key_fn = key_fn
        self.cost_fn = cost_fn or (lambda params: 0)
        self.max_batch_tokens = max_batch_tokens
        self._waiting: deque[DiffusionRequest] = deque()
        self._running: dict[str, DiffusionRequest] = {}  # insertion order is admission order
        self._requests: dict[str, DiffusionRequest] = {}  # every active (waiting or running) request
        self._keys: dict[str, Hashable] = {}
        self._costs: dict[str, int] = {}
        self._ended_ids: list[str] = []  # reported in the next schedule()'s finished_ids
        self.num_preempted = 0  # pauses so far (metrics)
        self.clock: Callable[[], float] = time.monotonic  # deadlines are on this clock (tests replace it)
        self.tick_time = TickTimeModel()  # a step's seconds for its cost, fitted to the ticks (observe_tick)

    def add_request(self, request: DiffusionRequest) -> None:
        """Queue a request; a duplicate active request id (or a request not WAITING) raises ValueError."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already active")
        if request.status is not RequestStatus.WAITING:
            raise ValueError(f"request {request.request_id!r} is {request.status.value}, not waiting")
        self._check_request(request)
        self._keys[request.request_id] = self.key_fn(request.params)
        self._costs[request.request_id] = int(self.cost_fn(request.params))
        self._requests[request.request_id] = request
        self._enqueue(request)

    def urgency(self, request: DiffusionRequest) -> tuple:
        """(priority, rank within it), smaller first. The rank: 0 under `arrival`; steps left under
        `shortest_remaining`; under `deadline`, `deadline_rank`.

        A request that `max_head_bypass` later requests of its priority have passed goes first
        within its priority, so shorter (or more pressing) arrivals cannot starve it.
        """
        starved = request.num_passed >= self.max_head_bypass
        if self.admission_order == "deadline":
            return request.priority, (-1, request.arrival_time) if starved else self.deadline_rank(request)
        if self.admission_order == "arrival" or starved:
            return request.priority, 0
        return request.priority, request.num_steps - request.step_index

    def deadline_rank(self, request: DiffusionRequest) -> tuple[int, float]:
        """Earliest deadline first among requests that can still finish by theirs, then requests without one
        (oldest first), then those that cannot make it any more (least work left first): they are late
        anyway, and running them first would make others late too. "Can make it": now plus its steps left,
        each a step of its own at the measured tick time (`observe_tick`), is not past its deadline."""
        if request.deadline is None:
            return 1, request.arrival_time
        work = self.work_left_s(request)
        if self.clock() + work <= request.deadline:
            return 0, request.deadline
        return 2, work

    def cost(self, request_id: str) -> int:
        """What a request adds to a step's cost (an adapter without costs: every request costs 1)."""
        return max(1, self._costs[request_id])

    def work_left_s(self, request: DiffusionRequest, step_cost: Optional[int] = None) -> float:
        """Seconds of denoising left: its steps left, each at the measured seconds of a step of `step_cost`
        (default: the request alone); 0 before the first tick."""
        steps_left = request.num_steps - request.step_index
        return steps_left * self.tick_time.seconds(step_cost or self.cost(request.request_id))

    def observe_tick(self, seconds: float, sched_out: "SchedulerOutput") -> None:
        """A tick of `sched_out` took `seconds`: fit the tick time to its cost (`tick_time`), from which the
        `deadline` order estimates work left. Call before `update_from_output` ends requests."""
        self.tick_time.observe(sum(self.cost(i) for i in sched_out.scheduled_ids if i in self._costs), seconds)

    def _queue_order(self, request: DiffusionRequest) -> tuple:
        return (*self.urgency(request), request.arrival_time)

    def _enqueue(self, request: DiffusionRequest) -> None:
        """Into the waiting queue at its place (a paused request goes back to the place its
        arrival, and its steps left, earned it)."""
        self._waiting.append(request)
        self._sort_waiting()

    def _sort_waiting(self) -> None:
        """Passes change a waiting request's place under `shortest_remaining`, and time under `deadline`;
        the sort is stable."""
        self._waiting = deque(sorted(self._waiting, key=self._queue_order))

    def expire(self, now: float) -> list[DiffusionRequest]:
        """End every request that waits, never started, and whose deadline has passed; return them."""
        expired = [r for r in self._waiting if r.deadline is not None and now >= r.deadline and r.step_index == 0]
        for request in expired:
            self._waiting.remove(request)
            request.status = RequestStatus.FAILED
            request.error = RequestTimedOutError(f"request {request.request_id} timed out: not started within "
                                                 "its timeout")
            self._end(request)
        return expired

    def waiting_by_priority(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for request in self._waiting:
            counts[request.priority] = counts.get(request.priority, 0) + 1
        return counts

    def _fits_budget(self, request: DiffusionRequest, running_ids: Optional[Iterable[str]] = None) -> bool:
        """Within max_batch_tokens together with the running set (or `running_ids`); always true for a
        request alone."""
        running_ids = list(self._running if running_ids is None else running_ids)
        if not self.max_batch_tokens or not running_ids:
            return True
        used = sum(self._costs[i] for i in running_ids)
        return used + self._costs[request.request_id] <= self.max_batch_tokens

    def _check_request(self, request: DiffusionRequest) -> None:
        """A request needs steps to run and a start index inside them."""
        if request.num_steps <= 0:
            raise ValueError(f"request {request.request_id!r}: num_inference_steps must be > 0, got {request.num_steps}")
        if not 0 <= request.step_index < request.num_steps:
            raise ValueError(f"request {request.request_id!r}: step_index {request.step_index} "
                             f"is outside [0, {request.num_steps})")

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Plan the next tick: every running request again, plus whoever is admitted now."""

    def update_from_output(self, sched_out: SchedulerOutput, runner_out: RunnerOutput) -> list[DiffusionRequest]:
        """Apply the runner's results; return the requests that ended this tick (finished or failed)."""
        # Requests aborted during the tick are no longer running: their results are dropped.
        live = [self._running[i] for i in sched_out.scheduled_ids if i in self._running]
        for request in live:  # check everything before changing anything
            rid = request.request_id
            if rid in runner_out.errors:
                continue
            if rid not in runner_out.step_index:
                if rid in runner_out.finished:
                    continue
                raise RuntimeError(f"runner reported no progress for scheduled request {rid!r}")
            step = runner_out.step_index[rid]
            if not request.step_index <= step <= request.num_steps:
                raise RuntimeError(f"runner reported step {step} for request {rid!r} at step "
                                   f"{request.step_index} of {request.num_steps}")
        ended = []
        for request in live:
            rid = request.request_id
            error = runner_out.errors.get(rid)
            if error is not None:
                request.status = RequestStatus.FAILED
                request.error = error
            else:
                request.step_index = runner_out.step_index.get(rid, request.step_index)
                if rid not in runner_out.finished and (request.step_index < request.num_steps
                                                       or rid in runner_out.decoding):
                    continue
                request.status = RequestStatus.FINISHED
            self._end(request)
            ended.append(request)
        return ended

    def abort(self, request_ids: list[str]) -> list[DiffusionRequest]:
        """Abort waiting or running requests (unknown ids are ignored); return those that were active."""
        aborted = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            if request.status is RequestStatus.WAITING:
                self._waiting.remove(request)
            request.status = RequestStatus.ABORTED
            self._end(request)
            aborted.append(request)
        return aborted

    def get_request(self, request_id: str) -> Optional[DiffusionRequest]:
        """The active (waiting or running) request with this id, if any."""
        return self._requests.get(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def has_requests(self) -> bool:
        return self.num_waiting > 0 or self.num_running > 0

    def _admit(self, out: SchedulerOutput, request: Optional[DiffusionRequest] = None) -> None:
        """Move the head of the queue (or the given waiting request) into the running set."""
        if request is None:
            request = self._waiting.popleft()
        else:
            self._waiting.remove(request)
        for earlier in self._waiting:
            if earlier.priority == request.priority and earlier.arrival_time < request.arrival_time:
                earlier.num_passed += 1
        request.status = RequestStatus.RUNNING
        self._running[request.request_id] = request
        (out.running_ids if request.num_preemptions else out.new_ids).append(request.request_id)

    def _preempt(self, out: SchedulerOutput, request: DiffusionRequest) -> None:
        """Pause a running request between two steps: back to the waiting queue, its runner state kept."""
        del self._running[request.request_id]
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preempted += 1
        self._enqueue(request)
        out.preempted_ids.append(request.request_id)

    def _take_ended_ids(self) -> list[str]:
        ended, self._ended_ids = self._ended_ids, []
        return ended

    def _end(self, request: DiffusionRequest) -> None:
        self._running.pop(request.request_id, None)
        del self._requests[request.request_id]
        del self._keys[request.request_id]
        del self._costs[request.request_id]
        self._ended_ids.append(request.request_id)
