"""RequestScheduler: request mode, where one wave is one complete request-level forward.

A wave is admitted FIFO: the head of the queue plus the requests right behind it
that share its key, up to `max_num_seqs`. An incompatible request stops the
wave (head-of-line blocking, the seed's conservative policy), so admission order
is arrival order. A wave runs to completion within one tick.

Also here: `wait_for_admission`, the optional pause before a new wave's first
schedule() that lets a burst of arrivals coalesce (`request_batch_max_wait_ms`).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from engine_lib.request import DiffusionRequest, RequestStatus
from engine_lib.sched.base import KeyFn, RunnerOutput, Scheduler, SchedulerOutput

# The count must stay flat this long (capped at a fifth of the max wait) to count as "stable".
STABLE_WINDOW_S = 0.05


class RequestScheduler(Scheduler):
    """FIFO waves of compatible requests; one wave in flight at a time. Not thread-safe: the engine locks."""

    def __init__(self, max_num_seqs: int, key_fn: KeyFn):
        super().__init__(max_num_seqs, key_fn)
        self._wave: Optional[list[str]] = None  # ids scheduled and not yet updated

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._take_ended_ids())
        if self._wave is not None or not self._waiting:
            return out
        head_key = self._keys[self._waiting[0].request_id]
        while (self._waiting and len(out.new_ids) < self.max_num_seqs
               and self._keys[self._waiting[0].request_id] == head_key):
            self._admit(out)
        self._wave = list(out.new_ids)
        return out

    def update_from_output(self, sched_out: SchedulerOutput, runner_out: RunnerOutput) -> list[DiffusionRequest]:
        if self._wave is None and sched_out.is_empty:
            return []
        assert sched_out.scheduled_ids == self._wave, "update_from_output for a wave that is not in flight"
        # Requests aborted during the wave are no longer running: their results are dropped.
        live = [self._running[i] for i in sched_out.scheduled_ids if i in self._running]
        missing = [r.request_id for r in live
                   if r.request_id not in runner_out.finished and r.request_id not in runner_out.errors]
        if missing:
            raise RuntimeError(f"runner returned no result for scheduled requests {missing}")
        self._wave = None
        for request in live:
            error = runner_out.errors.get(request.request_id)
            if error is not None:
                request.status = RequestStatus.FAILED
                request.error = error
            else:
                request.status = RequestStatus.FINISHED
            self._end(request)
        return live


def wait_for_admission(cond: threading.Condition, num_waiting: Callable[[], int], capacity: int,
                       max_wait_s: float, stopped: Callable[[], bool],
                       clock: Callable[[], float] = time.monotonic) -> str:
    """Hold back a new wave's first schedule() so that a burst of arrivals can join it.

    Call with `cond` held, when nothing is running, capacity > 1 and max_wait_s > 0;
    arrivals and stop must `cond.notify_all()`. Returns why the wait ended:
    "capacity" (a full wave is waiting), "stable" (the count has not grown for
    min(50 ms, max_wait_s / 5)), "deadline" (max_wait_s passed) or "stopped".
    """
    window = min(STABLE_WINDOW_S, max_wait_s / 5)
    start = clock()
    deadline = start + max_wait_s
    last_count = num_waiting()
    last_growth = start
    while True:
        if stopped():
            return "stopped"
        count = num_waiting()
        if count >= capacity:
            return "capacity"
        now = clock()
        if count > last_count:
            last_growth = now
        last_count = count
        if now >= deadline:
            return "deadline"
        if now - last_growth >= window:
            return "stable"
        cond.wait(timeout=min(deadline, last_growth + window) - now)
