"""StepScheduler: step mode, where requests join and leave the running batch between denoise steps.

The running set holds requests of one key, up to `max_num_seqs`. Between ticks,
waiting requests join FIFO while there is room and their key matches the running
set's (any key when it is empty); an incompatible head blocks those behind it
(head-of-line blocking, as in the seed). Requests with different step counts and
at different steps share ticks; the runner reports each one's progress.
"""

from __future__ import annotations

from engine_lib.sched.base import Scheduler, SchedulerOutput


class StepScheduler(Scheduler):
    """Continuous batching over denoise steps. Not thread-safe: the engine locks."""

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(running_ids=list(self._running), finished_ids=self._take_ended_ids())
        running_key = self._keys[out.running_ids[0]] if out.running_ids else None
        while self._waiting and len(self._running) < self.max_num_seqs:
            key = self._keys[self._waiting[0].request_id]
            if self._running and key != running_key:
                break
            running_key = key
            self._admit(out)
        return out
