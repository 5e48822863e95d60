"""Requests, their sampling parameters, their outputs and the engine's error types.

Plain dataclasses with no torch: the schedulers and the Triton edge use them
without importing a model. Only the scheduler writes a request's `status`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional


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


class RequestCancelledError(EngineError):
    """The client cancelled the request (or it was aborted)."""

    code = "CANCELLED"


class PipelineError(EngineError):
    """The pipeline failed while running this request."""

    code = "INTERNAL"


class ConfigError(ValueError):
    """A model configuration parameter is invalid; raised at load, names the parameter."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.FAILED)


@dataclass(frozen=True)
class SamplingParams:
    """What the user asked for. Validated at the edge; adapters may check more (`validate`)."""

    prompt: str
    negative_prompt: Optional[str] = None
    height: int = 64
    width: int = 64
    num_inference_steps: int = 4
    guidance_scale: Optional[float] = None
    true_cfg_scale: float = 1.0
    seed: int = 0
    num_images: int = 1
    preview_interval: int = 0
    output_format: str = "raw"
    num_frames: Optional[int] = None
    max_sequence_length: Optional[int] = None
    lora_name: Optional[str] = None
    lora_scale: float = 1.0

    @property
    def do_true_cfg(self) -> bool:
        """Qwen-Image style CFG: on only with a negative prompt and a scale above 1 (as diffusers)."""
        return self.negative_prompt is not None and self.true_cfg_scale > 1.0


@dataclass
class DiffusionRequest:
    """One logical request inside the engine. Status and progress are written by the scheduler only."""

    request_id: str
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    step_index: int = 0
    error: Optional[EngineError] = None

    @property
    def num_steps(self) -> int:
        return self.params.num_inference_steps


@dataclass
class DiffusionOutput:
    """One item of a request's output stream.

    Intermediate items carry progress and maybe a preview; the final one carries
    the images (uint8 [N, H, W, 3], or [N, F, H, W, 3] for video) or an error.
    """

    request_id: str
    step: int
    num_steps: int
    is_final: bool
    images: Any = None  # numpy uint8 array or None
    error: Optional[EngineError] = None

    @property
    def ok(self) -> bool:
        return self.error is None
