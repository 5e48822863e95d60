"""Requests, their sampling parameters, their outputs and the engine's error types.

Plain dataclasses with no torch: the schedulers and the Triton edge use them
without importing a model. Only the scheduler writes a request's `status`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional


class EngineError(Exception):
    """Base of every error a request can end with; `code` maps to a Triton error code."""

    code = "INTERNAL"


class InvalidInputError(EngineError, ValueError):
    """A user input is out of range. The message names the input and the allowed range."""

    code = "INVALID_ARG"

    def __init__(self, name: str, message: str):
        super().__init__(f"input '{name}': {message}")
        self.input_name = name


class EngineUnavailableError(EngineError):
    """The engine is shutting down or its queue is full; the client may retry later."""

    code = "UNAVAILABLE"


class RequestTimedOutError(EngineError):
    """The request's deadline (Triton's request timeout) passed before it started; it cost no device time.
    UNAVAILABLE, as Triton's own queue reports an expired timeout."""

    code = "UNAVAILABLE"


class RequestCancelledError(EngineError):
    """The client cancelled the request (or it was aborted)."""

    code = "CANCELLED"


class PipelineError(EngineError):
    """The pipeline failed while running this request."""

    code = "INTERNAL"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.FAILED)


class SamplingParams(Mapping[str, Any]):
    """One request's inputs by their declared names, as validated (`InputSchema.parse`); immutable.

    Which inputs exist is the pipeline's declaration (engine_lib/interface.py),
    not this class: `params.height` reads the `height` input, `params["height"]`
    too. Equal inputs give equal (and equally hashed) params.
    """

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any] = (), **more: Any):
        object.__setattr__(self, "_values", {**dict(values), **more})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"these params have no input {name!r} (they have: {', '.join(self._values)})") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("SamplingParams are immutable: use replace()")

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __hash__(self) -> int:
        return hash(frozenset(self._values.items()))

    def __repr__(self) -> str:
        return f"SamplingParams({self._values!r})"

    def __reduce__(self):
        return (SamplingParams, (self._values,))

    def replace(self, **changes: Any) -> "SamplingParams":
        """A copy with some inputs changed (tests and benchmarks; not re-validated)."""
        return SamplingParams({**self._values, **changes})


@dataclass
class DiffusionRequest:
    """One logical request inside the engine. Status and progress are written by the scheduler only."""

    request_id: str
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    step_index: int = 0
    error: Optional[EngineError] = None
    priority: int = 1  # 1 most urgent; the engine resolves the `priority` input (0: the model's default)
    timeout_at: Optional[float] = None  # time.monotonic() when Triton's request timeout runs out
    num_preemptions: int = 0  # times it was paused between steps for a more urgent request
    num_passed: int = 0  # later requests of its priority admitted while it waited (bounded by the scheduler)
    num_steps: int = 0  # denoise steps (ticks) it runs: the adapter's `total_steps` (0: num_inference_steps)

    def __post_init__(self) -> None:
        if not self.num_steps:
            self.num_steps = int(self.params.num_inference_steps)


@dataclass
class DiffusionOutput:
    """One item of a request's output stream.

    Intermediate items carry progress and maybe a preview; the final one carries
    the outputs or an error. `outputs` maps the adapter's declared output names
    (`image`, later `video`, `audio`, ...) to numpy arrays in their declared dtypes.
    """

    request_id: str
    step: int
    num_steps: int
    is_final: bool
    outputs: dict = field(default_factory=dict)  # output name -> numpy array
    error: Optional[EngineError] = None

    @property
    def ok(self) -> bool:
        return self.error is None
