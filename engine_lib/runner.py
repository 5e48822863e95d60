"""ModelRunner: the one denoise loop, and the only place requests become tensors and tensors outputs.

Each tick runs the seed's step contract over the scheduled requests: prepare
the new ones, one batched denoise forward, each request's own scheduler step,
previews at their boundaries, one batched decode of the requests that finished.
Request mode and step mode both run here (they differ only in who the scheduler
admits when), so they share fault isolation and previews. The runner never
imports the scheduler: it reads request ids and parameters and reports a
`RunnerOutput`. All of its state is owned by the engine's busy-loop thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from engine_lib import host_copy
from engine_lib.phases import PhaseClock
from engine_lib.pipelines.base import InputBatch, Outputs, PipelineAdapter, Prediction, RequestState, move_tensors
from engine_lib.request import DiffusionRequest, EngineError, PipelineError
from engine_lib.sched.base import RunnerOutput

logger = logging.getLogger(__name__)

DECODE_GROUP = 4  # a group this large decodes at once: one VAE call's cost per image stops falling (measured)


@dataclass
class RunnerResult:
    """One tick's results: progress for the scheduler, final outputs and previews for the streams."""

    output: RunnerOutput = field(default_factory=RunnerOutput)
    outputs: dict[str, Outputs] = field(default_factory=dict)  # request id -> named arrays (finished requests)
    previews: dict[str, Outputs] = field(default_factory=dict)
    chunks: dict[str, Outputs] = field(default_factory=dict)  # what a request decoded as it went (video chunks)
    forward_size: int = 0  # requests in the tick's denoise forward (not those only waiting for their decode)
    batch_retries: int = 0  # batched denoise forwards that failed and ran again one request at a time

    def fail(self, request_id: str, exc: BaseException) -> None:
        error = exc if isinstance(exc, EngineError) else PipelineError(f"{type(exc).__name__}: {exc}")
        self.output.errors[request_id] = error
        logger.warning("request %s failed: %s", request_id, error)


class ModelRunner:
    """Runs one tick of the step contract (`execute_step`) over an adapter.

    `float_outputs`: hand back the pipeline's own float outputs instead of the
    declared dtypes (tests and benchmarks compare them before the uint8 rounding).
    `fail_prompt` (tests only, the `test_fail_prompt` parameter): a batch holding a
    request with exactly this prompt fails its denoise forward, as a pipeline error would.
    """

    def __init__(self, adapter: PipelineAdapter, float_outputs: bool = False, fail_prompt: str = "",
                 clock: Optional[PhaseClock] = None, decode_group_ticks: int = 0):
        self.adapter = adapter
        self.float_outputs = float_outputs
        self.fail_prompt = fail_prompt
        self.clock = clock or PhaseClock()  # seconds per phase of the tick (engine_lib/phases.py)
        # see _decode_now; only for adapters whose post_decode batches its states (one VAE call for several)
        self.decode_group_ticks = decode_group_ticks if adapter.batched_decode else 0
        self._held: dict[str, int] = {}  # denoised, decode held for a group: request id -> ticks held
        self._output_specs = {spec.name: spec for spec in adapter.outputs}
        self.states: dict[str, RequestState] = {}  # owned by the busy-loop thread
        self._input_batch: Optional[InputBatch] = None
        self._paused: set[str] = set()  # states moved to host memory while their request is paused
        self.frames_generated = 0  # frames of every finished `video` output (a monotone total, for the metrics)
        self.host = host_copy.HostCopier()

    def execute_step(self, new: list[DiffusionRequest], running: list[DiffusionRequest]) -> RunnerResult:
        """prepare_encode the new requests, one batched denoise step, per-request scheduler steps,
        previews at their boundaries, and one batched decode of the requests that finished."""
        result = RunnerResult()
        with self.clock.phase("prepare"):
            for request in new:
                self._prepare(request, result)
        for request in running:
            if request.request_id in self._paused:  # resumed: back onto the device
                self._paused.discard(request.request_id)
                move_tensors(self.states[request.request_id], self.adapter.device)
        active = [self.states[r.request_id] for r in new + running if r.request_id in self.states]
        denoising = [s for s in active if not s.denoise_completed]  # the others wait for their decode
        result.forward_size = len(denoising)
        if denoising:
            self._denoise(denoising, result)
        done = [s for s in active if s.request_id not in result.output.errors]
        for state in done:
            result.output.step_index[state.request_id] = state.step_index
        with self.clock.phase("decode"):
            self._collect_chunks(done, result)
        done = [s for s in done if s.request_id not in result.output.errors]
        with self.clock.phase("previews"):
            self._emit_previews([s for s in done if not s.denoise_completed], result)
        denoised = [s for s in done if s.denoise_completed]
        priority = {r.request_id: r.priority for r in new + running}
        decode_now = self._decode_now(denoised, [s for s in done if not s.denoise_completed], priority)
        result.output.decoding.update({s.request_id for s in denoised} - {s.request_id for s in decode_now})
        self._decode(decode_now, result)
        with self.clock.phase("convert"):
            self._to_host(result)
        self.free(list(result.output.errors) + list(result.output.finished))
        return result

    def run_to_completion(self, requests: list[DiffusionRequest]) -> RunnerResult:
        """Run requests admitted together, tick by tick, until each has finished or failed.

        For offline callers (benchmarks, tests): what a request-mode wave does in
        the engine, without the engine's threads. Returns the final outputs and
        errors (previews are dropped).
        """
        total = RunnerResult()
        new, running = list(requests), []
        while new or running:
            tick = self.execute_step(new, running)
            total.outputs.update(tick.outputs)
            total.output.finished |= tick.output.finished
            total.output.errors.update(tick.output.errors)
            ended = tick.output.finished | set(tick.output.errors)
            new, running = [], [r for r in new + running if r.request_id not in ended]
        return total

    def _prepare(self, request: DiffusionRequest, result: RunnerResult) -> None:
        state = self.adapter.state_class(request.request_id, request.params, step_index=request.step_index,
                                         num_steps=request.num_steps)
        try:
            self.adapter.prepare_encode(state)
        except Exception as exc:  # noqa: BLE001 - the request ends alone with its error
            result.fail(request.request_id, exc)
            return
        self.states[request.request_id] = state

    def _denoise(self, states: list[RequestState], result: RunnerResult) -> None:
        """One batched denoise forward, then the scheduler steps: batched where the adapter can
        (`step_batch`), else each request's own."""
        try:
            batch, prediction = self._predict(states)
        except Exception as exc:  # noqa: BLE001
            if len(states) == 1:
                result.fail(states[0].request_id, exc)
                return
            # denoise_step mutates nothing, so each request can simply be retried alone.
            logger.warning("batched denoise of %d requests failed (%s); retrying one by one", len(states), exc)
            result.batch_retries += 1
            self._input_batch = None
            for state in states:
                self._denoise([state], result)
            return
        with self.clock.phase("scheduler"), torch.inference_mode():
            try:
                if self.adapter.step_batch(batch, states, prediction):
                    return
            except Exception as exc:  # noqa: BLE001 - step_batch changes nothing before it succeeds
                logger.warning("batched scheduler step failed (%s); stepping each request alone", exc)
            for state, pred in zip(states, batch.split(prediction)):
                try:
                    self.adapter.step_scheduler(state, pred)
                except Exception as exc:  # noqa: BLE001
                    result.fail(state.request_id, exc)

    def _predict(self, states: list[RequestState]) -> tuple[InputBatch, Prediction]:
        if self.fail_prompt and any(s.params.get("prompt") == self.fail_prompt for s in states):
            raise PipelineError(f"injected failure for the prompt {self.fail_prompt!r} (test_fail_prompt)")
        with self.clock.phase("gather"):
            batch = InputBatch.gather(states, previous=self._input_batch)
        self._input_batch = batch
        with self.clock.phase("forward"), torch.inference_mode():
            return batch, self.adapter.denoise_step(batch, states=states)

    def _decode_now(self, denoised: list[RequestState], denoising: list[RequestState],
                    priority: dict[str, int]) -> list[RequestState]:
        """The denoised requests to decode this tick. With `decode_group_ticks` N > 0, requests that finish
        denoising in nearby ticks decode in one VAE call: a denoised request waits (at most N ticks) while
        another running request, as urgent or more, will finish within its wait, and the group is still
        small. In continuous batching requests finish one tick apart, and one VAE call for several images
        costs much less per image than one call each (docs/benchmarks.md)."""
        if not denoised or self.decode_group_ticks <= 0:
            return denoised
        most_urgent = min(priority.get(s.request_id, 0) for s in denoised)
        soonest = min((s.num_steps - s.step_index for s in denoising
                       if priority.get(s.request_id, 0) <= most_urgent), default=None)
        held = [self._held.get(s.request_id, 0) for s in denoised]
        if soonest is None or len(denoised) >= DECODE_GROUP or max(held) + soonest > self.decode_group_ticks:
            for state in denoised:
                self._held.pop(state.request_id, None)
            return denoised
        for state in denoised:
            self._held[state.request_id] = self._held.get(state.request_id, 0) + 1
        return []

    def _collect_chunks(self, states: list[RequestState], result: RunnerResult) -> None:
        for state in states:
            try:
                with torch.inference_mode():
                    chunk = self.adapter.chunk_outputs(state)
                if chunk is not None:
                    result.chunks[state.request_id] = self._declared(chunk, as_float=self.float_outputs)
            except Exception as exc:  # noqa: BLE001
                result.fail(state.request_id, exc)

    def _emit_previews(self, states: list[RequestState], result: RunnerResult) -> None:
        for state in states:
            k = state.params.get("preview_interval", 0)
            if k > 0 and state.step_index % k == 0:
                try:
                    result.previews[state.request_id] = self._declared(self.adapter.preview(state), as_float=False)
                except Exception as exc:  # noqa: BLE001
                    result.fail(state.request_id, exc)

    def _decode(self, states: list[RequestState], result: RunnerResult) -> None:
        if not states:
            return
        try:
            with self.clock.phase("decode"), torch.inference_mode():
                outputs = self.adapter.post_decode(states)
            if len(outputs) != len(states):
                raise PipelineError(f"{self.adapter.name}.post_decode returned {len(outputs)} outputs for {len(states)}")
            with self.clock.phase("convert"):
                outputs = [self._declared(o, as_float=self.float_outputs) for o in outputs]
        except Exception as exc:  # noqa: BLE001
            if len(states) == 1:
                result.fail(states[0].request_id, exc)
                return
            for state in states:
                self._decode([state], result)
            return
        for state, named in zip(states, outputs):
            result.outputs[state.request_id] = named
            result.output.finished.add(state.request_id)
            if "video" in named:  # [N, F, H, W, 3]
                self.frames_generated += named["video"].shape[0] * named["video"].shape[1]

    def _declared(self, outputs: Outputs, as_float: bool) -> Outputs:
        """Named arrays (or device tensors) checked against the declaration, converted to the declared
        dtypes unless `as_float` (tensors where they are: `_to_host` brings them back)."""
        undeclared = sorted(set(outputs) - set(self._output_specs))
        if undeclared:
            raise PipelineError(f"{self.adapter.name} produced undeclared outputs {undeclared}")
        if as_float:
            return dict(outputs)
        specs = self._output_specs
        return {name: host_copy.convert(specs[name], a) if isinstance(a, torch.Tensor) else specs[name].convert(a)
                for name, a in outputs.items()}

    def _to_host(self, result: RunnerResult) -> None:
        """Every tensor of the tick's outputs, previews and chunks to numpy, with one host synchronisation."""
        slots = [(named, name) for group in (result.outputs, result.previews, result.chunks)
                 for named in group.values() for name, value in named.items() if isinstance(value, torch.Tensor)]
        for (named, name), array in zip(slots, self.host.to_host([named[name] for named, name in slots])):
            named[name] = array

    def pause(self, request_ids: list[str]) -> None:
        """Preempted between two steps: keep the state, in host memory when it lives on a GPU."""
        if self.adapter.device.type == "cpu":
            return
        for request_id in request_ids:
            state = self.states.get(request_id)
            if state is not None:
                move_tensors(state, torch.device("cpu"))
                self._paused.add(request_id)

    def free(self, request_ids: list[str]) -> None:
        """Drop the step state of ended or aborted requests."""
        for request_id in request_ids:
            self._paused.discard(request_id)
            self._held.pop(request_id, None)
            if self.states.pop(request_id, None) is not None and self._input_batch is not None:
                self._input_batch = None

    @property
    def num_states(self) -> int:
        return len(self.states)
