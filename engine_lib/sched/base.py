"""What the schedulers exchange with the engine: pure Python, request ids only, no tensors."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional

from engine_lib.request import DiffusionRequest, EngineError, SamplingParams

KeyFn = Callable[[SamplingParams], Hashable]


@dataclass
class SchedulerOutput:
    """One tick's plan.

    new_ids: admitted this tick (step mode: the runner must `prepare_encode` them).
    running_ids: admitted earlier and scheduled again this tick (step mode only).
    finished_ids: requests that ended since the last tick (finished, failed or
        aborted); the runner frees any state it still holds for them.
    """

    new_ids: list[str] = field(default_factory=list)
    running_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)

    @property
    def scheduled_ids(self) -> list[str]:
        return self.new_ids + self.running_ids

    @property
    def is_empty(self) -> bool:
        return not self.new_ids and not self.running_ids


@dataclass
class RunnerOutput:
    """What the runner reports back for one tick.

    step_index: step mode: each scheduled request's progress after this tick.
    finished: requests whose final result the runner produced this tick.
    errors: requests that failed this tick (they end alone; batch-mates go on).
    """

    step_index: dict[str, int] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    errors: dict[str, EngineError] = field(default_factory=dict)


class Scheduler(ABC):
    """FIFO admission into a running set that shares one compatibility key."""

    def __init__(self, max_num_seqs: int, key_fn: KeyFn):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.max_num_seqs = max_num_seqs
        self.key_fn = key_fn

    @abstractmethod
    def add_request(self, request: DiffusionRequest) -> None:
        """Queue a request; a duplicate active request id raises ValueError."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Plan the next tick."""

    @abstractmethod
    def update_from_output(self, sched_out: SchedulerOutput, runner_out: RunnerOutput) -> list[DiffusionRequest]:
        """Apply the runner's results; return the requests that ended this tick."""

    @abstractmethod
    def abort(self, request_ids: list[str]) -> list[DiffusionRequest]:
        """Abort waiting or running requests; return those that were active."""

    @abstractmethod
    def get_request(self, request_id: str) -> Optional[DiffusionRequest]:
        """The active (waiting or running) request with this id, if any."""

    @property
    @abstractmethod
    def num_waiting(self) -> int: ...

    @property
    @abstractmethod
    def num_running(self) -> int: ...

    @property
    def has_requests(self) -> bool:
        return self.num_waiting > 0 or self.num_running > 0
