"""ModelRunner: the one denoise loop, and the only place requests become tensors and tensors outputs.

Each tick runs the step contract (docs/pipelines.md) over the scheduled requests: prepare
the new ones, one batched denoise forward, each request's own scheduler step,
previews at their boundaries, one batched decode of the requests that finished.
Request mode and step mode both run here (they differ only in who the scheduler
admits when), so they share fault isolation and previews. The runner never
imports the scheduler: it reads request ids and parameters and reports a
`RunnerOutput`; it decides nothing about who runs (the scheduler's plan says
whose decode waits). All of its state is owned by the engine's busy-loop thread.
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from typing import Any, Callable, Iterator, Optional

import torch

from engine_lib import host_copy
from engine_lib.phases import PhaseClock
from engine_lib.pipelines.base import InputBatch, Outputs, PipelineAdapter, Prediction, RequestState, move_tensors
from engine_lib.request import DiffusionRequest, PipelineError
from engine_lib.sched.outputs import RunnerOutput

logger = logging.getLogger(__name__)

BeforeForward = Callable[[list[RequestState]], None]  # may raise: the forward fails as a pipeline error would
BeforeBlock = Callable[[list[DiffusionRequest]], None]  # tests: called with the tick's requests at each block


class TickInterrupted(BaseException):
    """A tick stopped at a block boundary: every request in it was cancelled, or the engine is closing.

    A BaseException, as asyncio.CancelledError is, so the runner's fault isolation (`except Exception`)
    never takes it for a failing request to retry alone."""


def _blocks(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The elements of every ModuleList of `module` not nested in another one's element: transformer blocks,
    a VAE's up blocks, a text encoder's layers (not the layers inside a block)."""
    for child in module.children():
        if isinstance(child, torch.nn.ModuleList):
            yield from child
        else:
            yield from _blocks(child)


HOST_LEAD_BLOCKS = 2  # on CUDA, how many blocks the host may run ahead of the device within a tick


class BlockBoundaries:
    """Forward pre-hooks on the blocks of the pipeline's modules, where a long tick (a big video forward, a
    tiled VAE decode) stops once `interrupt` is set. Inert outside its runner's ticks (`requests` None), so a
    hook left on a shared adapter by another runner never acts.

    On CUDA the host only queues kernels: left alone it runs through every block of a forward long before the
    device does, and a stop at the host's boundary would still leave the queued blocks to run. So each
    boundary records an event on the device's stream and waits for the one HOST_LEAD_BLOCKS boundaries back:
    the device stays busy (two blocks queued) and a stop lands within two blocks of device time.
    `device_event(device)`: the event maker (tests pass a fake)."""

    def __init__(self, modules: list[torch.nn.Module], interrupt: Optional[threading.Event],
                 before_block: Optional[BeforeBlock], device: Optional[torch.device] = None,
                 device_event: Optional[Callable[[torch.device], Any]] = None):
        self.interrupt = interrupt
        self.before_block = before_block
        self.requests: Optional[list[DiffusionRequest]] = None  # the running tick's (engine thread)
        self.device = device
        if device_event is None and device is not None and torch.device(device).type == "cuda":
            device_event = _cuda_event
        self.device_event = device_event
        self.queued: collections.deque = collections.deque()  # events of the tick's last boundaries
        self.handles = [block.register_forward_pre_hook(self) for module in modules for block in _blocks(module)]

    def start(self, requests: list[DiffusionRequest]) -> None:
        self.requests = requests

    def end(self) -> None:
        self.requests = None
        self.queued.clear()

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        if self.requests is None:
            return
        if self.device_event is not None:
            self.queued.append(self.device_event(self.device))
            if len(self.queued) > HOST_LEAD_BLOCKS:
                self.queued.popleft().synchronize()
        if self.before_block is not None:
            self.before_block(self.requests)
        self.check()

    def check(self) -> None:
        if self.requests is not None and self.interrupt is not None and self.interrupt.is_set():
            raise TickInterrupted()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _cuda_event(device: torch.device) -> "torch.cuda.Event":
    """An event recorded now on `device`'s current stream (not the current device's: cuda:1 is not cuda:0)."""
    return torch.cuda.current_stream(device).record_event()


class ModelRunner:
    """Runs one tick of the step contract (`execute_step`) over an adapter.

    `float_outputs`: hand back the pipeline's own float outputs instead of the
    declared dtypes (tests and benchmarks compare them before the uint8 rounding).
    `before_forward`: called with the states of every denoise forward before it runs
    (tests inject failures with it; see engine_lib/hooks.py).
    `interrupt`: once set, the running tick stops at its next block boundary (or between its phases) and
    raises TickInterrupted (the engine sets it when every request of the tick is cancelled, or at close).
    `before_block`: called at each block boundary of a tick (tests make ticks slow with it).
    """

    def __init__(self, adapter: PipelineAdapter, float_outputs: bool = False,
                 clock: Optional[PhaseClock] = None, before_forward: Optional[BeforeForward] = None,
                 interrupt: Optional[threading.Event] = None, before_block: Optional[BeforeBlock] = None):
        self.adapter = adapter
        self.float_outputs = float_outputs
        self.before_forward = before_forward
        self.clock = clock or PhaseClock()  # seconds per phase of the tick (engine_lib/phases.py)
        self._output_specs = {spec.name: spec for spec in adapter.outputs}
        self.states: dict[str, RequestState] = {}  # owned by the busy-loop thread
        self._input_batch: Optional[InputBatch] = None
        self._paused: set[str] = set()  # states moved to host memory while their request is paused
        self.frames_generated = 0  # frames of every finished `video` output (a monotone total, for the metrics)
        self.host = host_copy.HostCopier()
        self._boundaries = BlockBoundaries([], None, None)
        if interrupt is not None or before_block is not None:
            self._boundaries = BlockBoundaries(adapter.torch_modules(), interrupt, before_block, adapter.device)
            weakref.finalize(self, self._boundaries.remove)

    def execute_step(self, new: list[DiffusionRequest], running: list[DiffusionRequest],
                     hold_decode_ids: frozenset[str] = frozenset()) -> RunnerOutput:
        """prepare_encode the new requests, one batched denoise step, per-request scheduler steps (a
        request whose latents are no longer finite fails alone), previews at their boundaries, and one
        batched decode of the requests that finished denoising (but those in `hold_decode_ids`, whose
        decode the scheduler holds for a later tick). Raises TickInterrupted when `interrupt` stops it."""
        self._boundaries.start(new + running)
        try:
            return self._execute_step(new, running, hold_decode_ids)
        finally:
            self._boundaries.end()

    def _execute_step(self, new: list[DiffusionRequest], running: list[DiffusionRequest],
                      hold_decode_ids: frozenset[str]) -> RunnerOutput:
        result = RunnerOutput()
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
        self._boundaries.check()
        if denoising:
            self._denoise(denoising, result)
            self._fail_non_finite([s for s in denoising if s.request_id not in result.errors], result)
        done = [s for s in active if s.request_id not in result.errors]
        for state in done:
            result.step_index[state.request_id] = state.step_index
        with self.clock.phase("decode"):
            self._collect_chunks(done, result)
        done = [s for s in done if s.request_id not in result.errors]
        with self.clock.phase("previews"):
            self._emit_previews([s for s in done if not s.denoise_completed], result)
        self._boundaries.check()
        self._decode([s for s in done if s.denoise_completed and s.request_id not in hold_decode_ids], result)
        with self.clock.phase("convert"):
            self._to_host(result)
        self.free(list(result.errors) + list(result.finished))
        return result

    @staticmethod
    def _fail(result: RunnerOutput, request_id: str, exc: BaseException) -> None:
        logger.warning("request %s failed: %s", request_id, result.fail(request_id, exc))

    def _prepare(self, request: DiffusionRequest, result: RunnerOutput) -> None:
        state = self.adapter.state_class(request.request_id, request.params, step_index=request.step_index,
                                         num_steps=request.num_steps)
        try:
            self.adapter.prepare_encode(state)
        except Exception as exc:  # noqa: BLE001 - the request ends alone with its error
            self._fail(result, request.request_id, exc)
            return
        self.states[request.request_id] = state

    def _denoise(self, states: list[RequestState], result: RunnerOutput) -> None:
        """One batched denoise forward, then the scheduler steps: batched where the adapter can
        (`step_batch`), else each request's own."""
        try:
            batch, prediction = self._predict(states)
        except Exception as exc:  # noqa: BLE001
            if len(states) == 1:
                self._fail(result, states[0].request_id, exc)
                return
            # denoise_step changes no request's state but its step caches, and those take the same step again
            # (taylorseer.ModuleFactors.update; a first-block cache is set once its forward has run), so each
            # request can simply be retried alone.
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
                    self._fail(result, state.request_id, exc)

    def _fail_non_finite(self, states: list[RequestState], result: RunnerOutput) -> None:
        """Fail (alone) each request whose latents hold NaN or inf after this step: its image would be
        garbage (black) counted as a success, and the rows beside it are unaffected. Cost per tick: one
        isfinite reduction over each request's latents, and one device sync for all of them (the flags are
        stacked and read at once), so the host waits for the step before it plans the next tick; a
        transformer forward dwarfs the kernel launches that overlap would have hidden."""
        checked = [(s, _latents(s)) for s in states]
        checked = [(s, tensors) for s, tensors in checked if tensors]
        if not checked:
            return
        with torch.inference_mode():
            flags = torch.stack([torch.stack([torch.isfinite(t).all() for t in tensors]).all()
                                 for _, tensors in checked])
        for (state, _), finite in zip(checked, flags.tolist()):
            if not finite:
                self._fail(result, state.request_id, PipelineError(
                    f"non-finite latents after step {state.step_index} of {state.num_steps}"))

    def _predict(self, states: list[RequestState]) -> tuple[InputBatch, Prediction]:
        if self.before_forward is not None:
            self.before_forward(states)
        with self.clock.phase("gather"):
            batch = InputBatch.gather(states, previous=self._input_batch)
        self._input_batch = batch
        with self.clock.phase("forward"), torch.inference_mode():
            return batch, self.adapter.denoise_step(batch, states=states)

    def _collect_chunks(self, states: list[RequestState], result: RunnerOutput) -> None:
        for state in states:
            try:
                with torch.inference_mode():
                    chunk = self.adapter.chunk_outputs(state)
                if chunk is not None:
                    result.chunks[state.request_id] = self._declared(chunk, as_float=self.float_outputs)
            except Exception as exc:  # noqa: BLE001
                self._fail(result, state.request_id, exc)

    def _emit_previews(self, states: list[RequestState], result: RunnerOutput) -> None:
        for state in states:
            k = state.params.get("preview_interval", 0)
            if k > 0 and state.step_index % k == 0:
                try:
                    result.previews[state.request_id] = self._declared(self.adapter.preview(state), as_float=False)
                except Exception as exc:  # noqa: BLE001
                    self._fail(result, state.request_id, exc)

    def _decode(self, states: list[RequestState], result: RunnerOutput) -> None:
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
                self._fail(result, states[0].request_id, exc)
                return
            for state in states:
                self._decode([state], result)
            return
        for state, named in zip(states, outputs):
            result.outputs[state.request_id] = named
            result.finished.add(state.request_id)
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

    def _to_host(self, result: RunnerOutput) -> None:
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
            state = self.states.pop(request_id, None)
            if state is not None:
                self.adapter.release(state)
                self._input_batch = None

    @property
    def num_states(self) -> int:
        return len(self.states)


def _latents(state: RequestState) -> list[torch.Tensor]:
    """A state's latents: every pipeline's state holds them as `latents`, one tensor or one per modality
    (LTX-2's video and audio)."""
    latents = getattr(state, "latents", None)
    if isinstance(latents, dict):
        return [t for t in latents.values() if isinstance(t, torch.Tensor)]
    return [latents] if isinstance(latents, torch.Tensor) else []
