"""StepScheduler: step mode, where every tick advances each running request one denoise step.

The running set holds requests of one key, up to `max_num_seqs`. Between ticks,
waiting requests join FIFO while there is room and their key matches the running
set's (any key when it is empty); an incompatible head blocks those behind it
(head-of-line blocking, as in the seed). Requests with different step counts and
at different steps share ticks; the runner reports each one's progress.
"""

from __future__ import annotations

from engine_lib.request import DiffusionRequest, RequestStatus
from engine_lib.sched.base import RunnerOutput, Scheduler, SchedulerOutput


class StepScheduler(Scheduler):
    """Continuous batching over denoise steps. Not thread-safe: the engine locks."""

    def _check_request(self, request: DiffusionRequest) -> None:
        """A step request needs steps to run and a start index inside them."""
        if request.num_steps <= 0:
            raise ValueError(f"request {request.request_id!r}: num_inference_steps must be > 0, got {request.num_steps}")
        if not 0 <= request.step_index < request.num_steps:
            raise ValueError(f"request {request.request_id!r}: step_index {request.step_index} "
                             f"is outside [0, {request.num_steps})")

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

    def update_from_output(self, sched_out: SchedulerOutput, runner_out: RunnerOutput) -> list[DiffusionRequest]:
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
                if rid not in runner_out.finished and request.step_index < request.num_steps:
                    continue
                request.status = RequestStatus.FINISHED
            self._end(request)
            ended.append(request)
        return ended
