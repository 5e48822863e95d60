"""Scheduler: the mechanism of admission, one denoise step per tick; a policy decides the order.

The scheduler owns the waiting queue, the running set (requests of one
compatibility key), each active request's key and cost, the compute budget
(`max_batch_tokens`: the running set's latent tokens x rows; 0: no limit; a
request alone is never refused by it), timeouts, abort, progress, and the ids
that ended since the last tick. Its `SchedulingPolicy` (policy.py) decides the
queue order within a priority level, which compatible requests may share a
step, and who may pause for whom. Two modes:

* **Step batching** (`step_execution`, continuous batching): between ticks,
  waiting requests join the running set in queue order while they have a seat,
  fit the budget and are compatible with it (any key when it is empty).
  - *Preemption.* When the head of the queue cannot join and the policy lets it
    preempt running requests (by default: it is more urgent), those pause
    between two steps, least urgent first (the latest admitted among equals),
    until it can: a compatible head needs a seat and room in the budget, an
    incompatible one needs the whole set to pause, or nothing pauses. A paused
    request keeps its runner state and resumes where it stopped. Each request
    pauses at most `max_preemptions` times (0: never).
  - *Passing, bounded.* When the head still cannot join, a request of its
    priority behind it that can may pass it. A waiting request is passed at most
    `max_head_bypass` times (`MAX_HEAD_BYPASS` in the engine; 0: strict order);
    then the policy ranks it first, and when it still cannot join it waits only
    for the running set to drain. A less urgent request never passes a more
    urgent one.
  - *Decode groups* (`group_decodes`, for adapters whose decode batches): a
    request done denoising holds its decode (at most `DECODE_HOLD_TICKS`) while
    another running request, as urgent or more, finishes within that wait, so
    both decode in one VAE call; requests in continuous batching finish a tick
    apart.
* **Request batching** (no `step_execution`): a wave is admitted only when
  nothing runs: the head plus the requests right behind it that share its key
  (which includes the step count), up to the seats and the budget; an
  incompatible request ends the wave. Nothing joins or pauses a running wave.
  With `request_batch_max_wait_ms` the first wave of a burst waits for the
  burst to stop growing (at most that long), so that it fills.

It takes its group of the engine's config (`SchedulerConfig`: seats, mode,
policy, budget, preemptions, the wait) and, from the adapter, the key and cost
of a request and whether its decode batches.

Not thread-safe: the engine calls it under its lock. Only the scheduler writes
a request's status.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Hashable, Iterable, Optional

from engine_lib.request import DiffusionRequest, RequestStatus, RequestTimedOutError, SamplingParams
from engine_lib.sched.outputs import RunnerOutput, SchedulerOutput
from engine_lib.sched.policy import make_policy

if TYPE_CHECKING:  # engine_lib.config imports the policies' names from this package
    from engine_lib.config import SchedulerConfig

KeyFn = Callable[[SamplingParams], Hashable]
CostFn = Callable[[SamplingParams], int]  # latent tokens x rows a request adds to one forward

MAX_HEAD_BYPASS = 16  # later requests that may pass a waiting one before it goes first
DECODE_GROUP = 4  # a decode group this large runs at once
DECODE_HOLD_TICKS = 2  # the longest a denoised request waits to share its decode
BURST_STABLE_S = 0.05  # a burst has stopped growing after this long without an arrival (capped at 1/5 of the wait)


class Scheduler:
    """Admission into a running set that shares one compatibility key; see the module docstring."""

    def __init__(self, config: SchedulerConfig, key_fn: KeyFn, *, cost_fn: Optional[CostFn] = None,
                 group_decodes: bool = False, max_head_bypass: int = MAX_HEAD_BYPASS):
        if config.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {config.max_num_seqs}")
        if config.max_preemptions < 0:
            raise ValueError(f"max_preemptions must be >= 0, got {config.max_preemptions}")
        step_batching = config.step_execution
        self.max_num_seqs = config.max_num_seqs
        self.max_head_bypass = max_head_bypass  # how many later requests may pass a waiting one (0: strict order)
        self.key_fn = key_fn
        self.step_batching = step_batching
        self.policy = make_policy(config.scheduling_policy)
        self.cost_fn = cost_fn or (lambda params: 0)
        self.max_batch_tokens = config.max_batch_tokens
        self.max_preemptions = config.max_preemptions if step_batching else 0
        self.group_decodes = group_decodes and step_batching
        self.admission_wait_s = config.admission_wait_s if not step_batching and config.max_num_seqs > 1 else 0.0
        self.clock: Callable[[], float] = time.monotonic  # timeouts are on this clock (tests replace it)
        self._waiting: deque[DiffusionRequest] = deque()
        self._running: dict[str, DiffusionRequest] = {}  # insertion order is admission order
        self._requests: dict[str, DiffusionRequest] = {}  # every active (waiting or running) request
        self._keys: dict[str, Hashable] = {}
        self._costs: dict[str, int] = {}
        self._ended_ids: list[str] = []  # reported in the next schedule()'s finished_ids
        self._ran_before: set[str] = set()  # the running set when this schedule() began
        self._decode_held: dict[str, int] = {}  # request id -> ticks its decode has waited
        self._burst: Optional[list[float]] = None  # request batching: [start, count, last growth] of a burst
        self.num_preempted = 0  # pauses so far (metrics)

    # -- requests in and out -----------------------------------------------
    def add_request(self, request: DiffusionRequest) -> None:
        """Queue a request; a duplicate active request id (or a request not WAITING) raises ValueError."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already active")
        if request.status is not RequestStatus.WAITING:
            raise ValueError(f"request {request.request_id!r} is {request.status.value}, not waiting")
        if request.num_steps <= 0:
            raise ValueError(f"request {request.request_id!r}: num_inference_steps must be > 0, got {request.num_steps}")
        if not 0 <= request.step_index < request.num_steps:
            raise ValueError(f"request {request.request_id!r}: step_index {request.step_index} "
                             f"is outside [0, {request.num_steps})")
        self._keys[request.request_id] = self.key_fn(request.params)
        self._costs[request.request_id] = int(self.cost_fn(request.params))
        self._requests[request.request_id] = request
        self._waiting.append(request)

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

    def expire(self, now: float) -> list[DiffusionRequest]:
        """End every waiting request that never started and whose timeout has run out; return them."""
        expired = [r for r in self._waiting if r.timeout_at is not None and now >= r.timeout_at and r.step_index == 0]
        for request in expired:
            self._waiting.remove(request)
            request.status = RequestStatus.FAILED
            request.error = RequestTimedOutError(f"request {request.request_id} timed out: not started within "
                                                 "its timeout")
            self._end(request)
        return expired

    # -- one tick --------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan the next tick: every running request again, plus whoever is admitted now."""
        out = SchedulerOutput(running_ids=list(self._running), finished_ids=self._take_ended_ids())
        self._ran_before = set(self._running)
        self._sort_waiting()
        if self.step_batching:
            self._join_between_steps(out)
            self._plan_decodes(out)
        elif not self._waiting:
            self._burst = None
        elif not self._running:
            out.retry_after_s = self._burst_wait()
            if not out.retry_after_s:
                self._admit_wave(out)
        return out

    def update_from_output(self, sched_out: SchedulerOutput, runner_out: RunnerOutput) -> list[DiffusionRequest]:
        """Apply the runner's results; return the requests that ended this tick (finished or failed)."""
        # Requests aborted during the tick are no longer running: their results are dropped.
        live = [self._running[i] for i in sched_out.scheduled_ids if i in self._running]
        for request in live:  # check everything before changing anything
            rid = request.request_id
            if rid in runner_out.errors or (rid not in runner_out.step_index and rid in runner_out.finished):
                continue
            if rid not in runner_out.step_index:
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
                                                       or rid in sched_out.hold_decode_ids):
                    continue
                request.status = RequestStatus.FINISHED
            self._end(request)
            ended.append(request)
        return ended

    def observe_tick(self, seconds: float, sched_out: SchedulerOutput) -> None:
        """A tick of `sched_out` took `seconds` (the policy may learn step times from it).
        Call before `update_from_output` ends requests."""
        self.policy.observe_tick(seconds, sum(self.cost(i) for i in sched_out.scheduled_ids if i in self._costs))

    # -- what the engine and the policy read ---------------------------------
    def get_request(self, request_id: str) -> Optional[DiffusionRequest]:
        """The active (waiting or running) request with this id, if any."""
        return self._requests.get(request_id)

    def cost(self, request_id: str) -> int:
        """What a request adds to a step's cost (an adapter without costs: every request costs 1)."""
        return max(1, self._costs[request_id])

    def urgency(self, request: DiffusionRequest) -> tuple:
        """(priority, the policy's rank within it): smaller goes first."""
        starved = request.num_passed >= self.max_head_bypass
        return request.priority, self.policy.rank(request, starved, self)

    def waiting_by_priority(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for request in self._waiting:
            counts[request.priority] = counts.get(request.priority, 0) + 1
        return counts

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def has_requests(self) -> bool:
        return self.num_waiting > 0 or self.num_running > 0

    # -- step batching ---------------------------------------------------------
    def _join_between_steps(self, out: SchedulerOutput) -> None:
        while self._waiting:
            head = self._waiting[0]
            if self._can_join(head) or self._make_room(out, head):
                self._admit(out)
                continue
            if len(self._running) >= self.max_num_seqs or head.num_passed >= self.max_head_bypass:
                break
            match = next((r for r in self._waiting if r.priority == head.priority and self._can_join(r)), None)
            if match is None:
                break
            self._admit(out, match)  # counts the pass

    def _can_join(self, request: DiffusionRequest) -> bool:
        if not self._running:
            return True
        return len(self._running) < self.max_num_seqs and self._compatible(request) and self._fits_budget(request)

    def _compatible(self, request: DiffusionRequest, other: Optional[DiffusionRequest] = None) -> bool:
        """Same key as `other` (default: the running set) and the policy lets them share a forward."""
        other = other or next(iter(self._running.values()))
        return (self._keys[request.request_id] == self._keys[other.request_id]
                and self.policy.can_share(request, other))

    def _make_room(self, out: SchedulerOutput, head: DiffusionRequest) -> bool:
        """Pause running requests the policy lets `head` preempt until it can join; pause none if that cannot
        work. Only requests that ran before this tick may pause (a new one has no state to keep yet)."""
        victims = [r for r in self._running.values() if r.request_id in self._ran_before
                   and r.num_preemptions < self.max_preemptions and self.policy.may_preempt(r, head, self.urgency)]
        victims.reverse()
        victims.sort(key=self.urgency, reverse=True)  # least urgent first; among equals, the latest admitted
        if not victims:
            return False
        if not self._compatible(head):
            chosen = victims if len(victims) == len(self._running) else []
        else:
            chosen = []
            for victim in victims:
                if self._room_after(chosen, head):
                    break
                chosen.append(victim)
            if not self._room_after(chosen, head):
                chosen = []
        for victim in chosen:
            self._preempt(out, victim)
        return bool(chosen)

    def _room_after(self, paused: list[DiffusionRequest], head: DiffusionRequest) -> bool:
        """Whether `head` would fit (a seat and the budget) once `paused` have left the running set."""
        left = [i for i in self._running if i not in {r.request_id for r in paused}]
        return not left or (len(left) < self.max_num_seqs and self._fits_budget(head, left))

    def _preempt(self, out: SchedulerOutput, request: DiffusionRequest) -> None:
        """Pause a running request between two steps: back to the waiting queue, its runner state kept."""
        del self._running[request.request_id]
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preempted += 1
        self._waiting.append(request)
        self._sort_waiting()  # back to the place its arrival (and the policy) earned it
        out.running_ids.remove(request.request_id)
        out.preempted_ids.append(request.request_id)

    def _plan_decodes(self, out: SchedulerOutput) -> None:
        """Hold the decode of requests done denoising after this tick while another running request, as
        urgent or more, finishes within `DECODE_HOLD_TICKS` of their wait and the group is still small."""
        if not self.group_decodes:
            return
        scheduled = [self._running[i] for i in out.scheduled_ids]
        denoised = [r for r in scheduled if r.num_steps - r.step_index <= 1]
        if not denoised:
            return
        most_urgent = min(r.priority for r in denoised)
        soonest = min((r.num_steps - r.step_index - 1 for r in scheduled
                       if r.num_steps - r.step_index > 1 and r.priority <= most_urgent), default=None)
        held = max(self._decode_held.get(r.request_id, 0) for r in denoised)
        if soonest is None or len(denoised) >= DECODE_GROUP or held + soonest > DECODE_HOLD_TICKS:
            for request in denoised:
                self._decode_held.pop(request.request_id, None)
            return
        for request in denoised:
            self._decode_held[request.request_id] = self._decode_held.get(request.request_id, 0) + 1
            out.hold_decode_ids.add(request.request_id)

    # -- request batching ------------------------------------------------------
    def _admit_wave(self, out: SchedulerOutput) -> None:
        head = self._waiting[0]
        while (self._waiting and len(out.new_ids) < self.max_num_seqs
               and self._compatible(self._waiting[0], head) and self._fits_budget(self._waiting[0])):
            self._admit(out)

    def _burst_wait(self) -> float:
        """Seconds the next wave should still wait for arrivals (0: admit now). It waits while the queue
        keeps growing, until a full wave waits or `admission_wait_s` has passed since the burst began."""
        if not self.admission_wait_s:
            return 0.0
        now, count = self.clock(), len(self._waiting)
        if self._burst is None:
            self._burst = [now, count, now]
        start, last_count, last_growth = self._burst
        if count > last_count:
            last_growth = now
        self._burst = [start, count, last_growth]
        window = min(BURST_STABLE_S, self.admission_wait_s / 5)
        wait = min(start + self.admission_wait_s, last_growth + window) - now
        if count >= self.max_num_seqs or wait <= 0:
            self._burst = None
            return 0.0
        return wait

    # -- shared ----------------------------------------------------------------
    def _sort_waiting(self) -> None:
        """Priority, the policy's rank, arrival (stable). Ranks change with passes and with time."""
        self._waiting = deque(sorted(self._waiting, key=lambda r: (*self.urgency(r), r.arrival_time)))

    def _fits_budget(self, request: DiffusionRequest, running_ids: Optional[Iterable[str]] = None) -> bool:
        """Within max_batch_tokens together with the running set (or `running_ids`); always true for a
        request alone."""
        running_ids = list(self._running if running_ids is None else running_ids)
        if not self.max_batch_tokens or not running_ids:
            return True
        used = sum(self._costs[i] for i in running_ids)
        return used + self._costs[request.request_id] <= self.max_batch_tokens

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

    def _take_ended_ids(self) -> list[str]:
        ended, self._ended_ids = self._ended_ids, []
        return ended

    def _end(self, request: DiffusionRequest) -> None:
        self._running.pop(request.request_id, None)
        del self._requests[request.request_id]
        del self._keys[request.request_id]
        del self._costs[request.request_id]
        self._decode_held.pop(request.request_id, None)
        self._ended_ids.append(request.request_id)
