"""RequestScheduler: request mode, where a wave of compatible requests runs to completion together.

A wave is admitted when nothing is running: the head of the queue (the most
urgent, then the oldest, or the shortest with `admission_order=shortest_remaining`,
or the earliest deadline still reachable with `admission_order=deadline`)
plus the requests right behind it that share its key (which includes the step
count), up to `max_num_seqs` and `max_batch_tokens`. An incompatible request
stops the wave (head-of-line blocking, the seed's conservative policy). Waves
are never preempted.
The wave then advances one denoise step per tick through the same runner path
as step mode (one loop, shared fault isolation and previews); nothing joins it
until every member has ended.

Also here: `wait_for_admission`, the optional pause before a new wave's first
schedule() that lets a burst of arrivals coalesce (`request_batch_max_wait_ms`).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from engine_lib.sched.base import Scheduler, SchedulerOutput

# The count must stay flat this long (capped at a fifth of the max wait) to count as "stable".
STABLE_WINDOW_S = 0.05


class RequestScheduler(Scheduler):
    """Waves of compatible requests; one wave in flight at a time. Not thread-safe: the engine locks."""

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(running_ids=list(self._running), finished_ids=self._take_ended_ids())
        if self._running or not self._waiting:
            return out
        self._sort_waiting()
        head_key = self._keys[self._waiting[0].request_id]
        while (self._waiting and len(out.new_ids) < self.max_num_seqs
               and self._keys[self._waiting[0].request_id] == head_key and self._fits_budget(self._waiting[0])):
            self._admit(out)
        return out


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
