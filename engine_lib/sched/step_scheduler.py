"""StepScheduler: step mode, where requests join and leave the running batch between denoise steps.

The running set holds requests of one key, up to `max_num_seqs`. Between ticks,
waiting requests join in arrival order while there is room and their key matches
the running set's (any key when it is empty). When the head of the queue does not
match, up to `max_head_bypass` requests behind it that do match may pass it (the
oldest first); then the head waits only for the running set to drain, and is
admitted first once it has. `max_head_bypass=0` is the seed's FIFO, where an
incompatible head blocks everyone behind it (head-of-line blocking). Requests with
different step counts and at different steps share ticks; the runner reports each
one's progress.
"""

from __future__ import annotations

from typing import Optional

from engine_lib.sched.base import KeyFn, Scheduler, SchedulerOutput


class StepScheduler(Scheduler):
    """Continuous batching over denoise steps. Not thread-safe: the engine locks."""

    def __init__(self, max_num_seqs: int, key_fn: KeyFn, max_head_bypass: int = 0):
        super().__init__(max_num_seqs, key_fn)
        if max_head_bypass < 0:
            raise ValueError(f"max_head_bypass must be >= 0, got {max_head_bypass}")
        self.max_head_bypass = max_head_bypass
        self._bypassed_head: Optional[str] = None  # the head that requests passed, and how often
        self._bypasses = 0

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(running_ids=list(self._running), finished_ids=self._take_ended_ids())
        running_key = self._keys[out.running_ids[0]] if out.running_ids else None
        while self._waiting and len(self._running) < self.max_num_seqs:
            head = self._waiting[0]
            if not self._running or self._keys[head.request_id] == running_key:
                running_key = self._keys[head.request_id]
                self._admit(out)
                continue
            if self._bypassed_head != head.request_id:
                self._bypassed_head, self._bypasses = head.request_id, 0
            if self._bypasses >= self.max_head_bypass:
                break
            match = next((r for r in self._waiting if self._keys[r.request_id] == running_key), None)
            if match is None:
                break
            self._admit(out, match)
            self._bypasses += 1
        return out
