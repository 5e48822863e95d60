"""What the scheduler and the runner hand each other once a tick: request ids, progress and named arrays.

No torch: the scheduler reads `RunnerOutput`'s ids and progress, the engine its arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine_lib.request import EngineError, PipelineError


@dataclass
class SchedulerOutput:
    """One tick's plan.

    new_ids: admitted this tick (the runner must `prepare_encode` them).
    running_ids: admitted earlier and scheduled again this tick (a paused request
        that resumes is one of them: the runner still holds its state).
    finished_ids: requests that ended since the last tick (finished, failed or
        aborted); the runner frees any state it still holds for them.
    preempted_ids: paused this tick; the runner keeps their state.
    hold_decode_ids: scheduled requests done denoising whose decode waits, so that
        a request finishing soon decodes with them in one call.
    retry_after_s: nothing scheduled yet on purpose (a burst is still arriving):
        schedule again after at most this many seconds, or at the next arrival.
    """

    new_ids: list[str] = field(default_factory=list)
    running_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    hold_decode_ids: set[str] = field(default_factory=set)
    retry_after_s: float = 0.0

    @property
    def scheduled_ids(self) -> list[str]:
        return self.new_ids + self.running_ids

    @property
    def is_empty(self) -> bool:
        return not self.new_ids and not self.running_ids


Outputs = dict[str, Any]  # output name -> numpy array (or, from an adapter, a tensor on its device)


@dataclass
class RunnerOutput:
    """One tick's results: progress for the scheduler, arrays for the output streams.

    step_index: each scheduled request's progress after this tick.
    finished: requests whose final result the runner produced this tick (in `outputs`).
    errors: requests that failed this tick (they end alone; batch-mates go on).
    previews / chunks: intermediate arrays (a preview at its interval; what a
        request decoded as it went, e.g. video chunks).
    forward_size: requests in the tick's denoise forward (not those only decoding).
    batch_retries: batched denoise forwards that failed and ran again one request at a time.
    """

    step_index: dict[str, int] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    errors: dict[str, EngineError] = field(default_factory=dict)
    outputs: dict[str, Outputs] = field(default_factory=dict)
    previews: dict[str, Outputs] = field(default_factory=dict)
    chunks: dict[str, Outputs] = field(default_factory=dict)
    forward_size: int = 0
    batch_retries: int = 0

    def fail(self, request_id: str, exc: BaseException) -> EngineError:
        """The request ends with `exc` (as an EngineError: a pipeline's own exception becomes INTERNAL)."""
        error = exc if isinstance(exc, EngineError) else PipelineError(f"{type(exc).__name__}: {exc}")
        self.errors[request_id] = error
        return error
