"""ModelRunner: the only place requests become tensors and tensors become images.

Request mode runs one `forward()` per wave; step mode runs one tick of the seed's
step contract over all scheduled requests. The runner never imports the
scheduler: it reads request ids and parameters and reports a `RunnerOutput`.
All of its state is owned by the engine's busy-loop thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from engine_lib.pipelines.base import DiffusionRequestBatch, InputBatch, PipelineAdapter, StepRequestState
from engine_lib.request import DiffusionRequest, EngineError, PipelineError
from engine_lib.sched.base import RunnerOutput

logger = logging.getLogger(__name__)


@dataclass
class RunnerResult:
    """One tick's results: progress for the scheduler, images and previews for the streams."""

    output: RunnerOutput = field(default_factory=RunnerOutput)
    images: dict[str, np.ndarray] = field(default_factory=dict)
    previews: dict[str, np.ndarray] = field(default_factory=dict)

    def fail(self, request_id: str, exc: BaseException) -> None:
        error = exc if isinstance(exc, EngineError) else PipelineError(f"{type(exc).__name__}: {exc}")
        self.output.errors[request_id] = error
        logger.warning("request %s failed: %s", request_id, error)


class ModelRunner:
    """Runs request waves (`execute_batch`) and step ticks (`execute_step`) on one adapter."""

    def __init__(self, adapter: PipelineAdapter):
        self.adapter = adapter
        self.states: dict[str, StepRequestState] = {}  # step mode; owned by the busy-loop thread
        self._input_batch: Optional[InputBatch] = None

    # -- request mode ---------------------------------------------------------
    def execute_batch(self, requests: list[DiffusionRequest]) -> RunnerResult:
        """One fused forward over the wave; if it fails, retry request by request so only the culprit fails."""
        result = RunnerResult()
        try:
            images = self._forward(requests)
        except Exception as exc:  # noqa: BLE001 - isolate the failing request below
            if len(requests) == 1:
                result.fail(requests[0].request_id, exc)
                return result
            logger.warning("fused forward of %d requests failed (%s); retrying one by one", len(requests), exc)
            for request in requests:
                one = self.execute_batch([request])
                result.output.finished |= one.output.finished
                result.output.errors.update(one.output.errors)
                result.images.update(one.images)
            return result
        for request, image in zip(requests, images):
            result.images[request.request_id] = image
            result.output.finished.add(request.request_id)
        return result

    def _forward(self, requests: list[DiffusionRequest]) -> list[np.ndarray]:
        images = self.adapter.forward(DiffusionRequestBatch(list(requests)))
        if len(images) != len(requests):
            raise PipelineError(f"{self.adapter.name}.forward returned {len(images)} outputs for {len(requests)} requests")
        return images

    # -- step mode ------------------------------------------------------------
    def execute_step(self, new: list[DiffusionRequest], running: list[DiffusionRequest]) -> RunnerResult:
        """prepare_encode the new requests, one batched denoise step, per-request scheduler steps,
        previews at their boundaries, and one batched decode of the requests that finished."""
        result = RunnerResult()
        for request in new:
            self._prepare(request, result)
        active = [self.states[r.request_id] for r in new + running if r.request_id in self.states]
        if active:
            self._denoise(active, result)
        done = [s for s in active if s.request_id not in result.output.errors]
        for state in done:
            result.output.step_index[state.request_id] = state.step_index
        self._emit_previews([s for s in done if not s.denoise_completed], result)
        self._decode([s for s in done if s.denoise_completed], result)
        self.free(list(result.output.errors) + list(result.output.finished))
        return result

    def _prepare(self, request: DiffusionRequest, result: RunnerResult) -> None:
        state = StepRequestState(request.request_id, request.params, step_index=request.step_index,
                                 num_steps=request.num_steps)
        try:
            self.adapter.prepare_encode(state)
        except Exception as exc:  # noqa: BLE001 - the request ends alone with its error
            result.fail(request.request_id, exc)
            return
        self.states[request.request_id] = state

    def _denoise(self, states: list[StepRequestState], result: RunnerResult) -> None:
        """One batched denoise forward, then each request's own scheduler step."""
        try:
            preds = self._predict(states)
        except Exception as exc:  # noqa: BLE001
            if len(states) == 1:
                result.fail(states[0].request_id, exc)
                return
            # denoise_step mutates nothing, so each request can simply be retried alone.
            logger.warning("batched denoise of %d requests failed (%s); retrying one by one", len(states), exc)
            self._input_batch = None
            for state in states:
                self._denoise([state], result)
            return
        for state, pred in zip(states, preds):
            try:
                with torch.inference_mode():
                    self.adapter.step_scheduler(state, pred)
            except Exception as exc:  # noqa: BLE001
                result.fail(state.request_id, exc)

    def _predict(self, states: list[StepRequestState]) -> list[torch.Tensor]:
        batch = InputBatch.gather(states, previous=self._input_batch)
        self._input_batch = batch
        with torch.inference_mode():
            return batch.split(self.adapter.denoise_step(batch, states=states))

    def _emit_previews(self, states: list[StepRequestState], result: RunnerResult) -> None:
        for state in states:
            k = state.params.preview_interval
            if k > 0 and state.step_index % k == 0:
                try:
                    result.previews[state.request_id] = self.adapter.preview(state)
                except Exception as exc:  # noqa: BLE001
                    result.fail(state.request_id, exc)

    def _decode(self, states: list[StepRequestState], result: RunnerResult) -> None:
        if not states:
            return
        try:
            with torch.inference_mode():
                images = self.adapter.post_decode(states)
            if len(images) != len(states):
                raise PipelineError(f"{self.adapter.name}.post_decode returned {len(images)} outputs for {len(states)}")
        except Exception as exc:  # noqa: BLE001
            if len(states) == 1:
                result.fail(states[0].request_id, exc)
                return
            for state in states:
                self._decode([state], result)
            return
        for state, image in zip(states, images):
            result.images[state.request_id] = image
            result.output.finished.add(state.request_id)

    def free(self, request_ids: list[str]) -> None:
        """Drop the step state of ended or aborted requests."""
        for request_id in request_ids:
            if self.states.pop(request_id, None) is not None and self._input_batch is not None:
                self._input_batch = None

    @property
    def num_states(self) -> int:
        return len(self.states)
