"""DiffusionEngine: mode selection, validation at admission, the busy loop, output streams, abort, close, warm-up.

One busy-loop thread owns the device. It calls `step()`, one synchronous tick that reads
like nano-vllm's `LLMEngine.step()`: schedule, execute, update, emit; every tick is one
denoise step, in both modes (the modes differ in the scheduler: who is admitted when).
Every other thread only enqueues (add_request, abort, close) under the engine's one lock
and wakes the loop. Built with `run_loop=False` there is no thread: tests and offline
callers call `step()` (or `generate()`) themselves.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Union

from engine_lib.config import EngineConfig, SchedulerConfig
from engine_lib.hooks import EngineHooks
from engine_lib.modes import EngineMode, select_mode
from engine_lib.phases import PhaseClock
from engine_lib.request import (
    DiffusionOutput,
    DiffusionRequest,
    EngineError,
    EngineUnavailableError,
    InvalidInputError,
    PipelineError,
    RequestCancelledError,
    RequestStatus,
    SamplingParams,
)
from engine_lib.runner import ModelRunner, TickInterrupted
from engine_lib.sched import RunnerOutput, Scheduler, SchedulerOutput
from engine_lib.worker_watch import WorkerWatch

logger = logging.getLogger(__name__)

Sink = Callable[[DiffusionOutput], None]


@dataclass(frozen=True)
class TickStats:
    """One busy-loop tick, handed to tick listeners (metrics) as plain numbers."""

    mode: EngineMode
    batch_size: int  # requests in the tick's denoise forward (0: none, e.g. every new request failed to prepare)
    seconds: float  # wall time of the tick's device work (one denoise step, with admission and decode)
    batch_retries: int = 0  # batched denoise forwards that failed in this tick and ran again one request at a time


@dataclass(frozen=True)
class EngineStats:
    """The engine's own counters: what is alive right now."""

    num_waiting: int
    num_running: int
    num_runner_states: int  # step states the runner holds
    num_streams: int  # open output streams / sinks
    thread_alive: bool
    waiting_by_priority: Optional[Mapping[int, int]] = None  # priority level -> requests waiting
    num_preempted: int = 0  # pauses so far
    phase_seconds: Optional[Mapping[str, float]] = None  # seconds per phase so far (engine_lib/phases.py)
    counters: Optional[Mapping[str, float]] = None  # the adapter's monotone totals (prompt cache hits, ...)
    num_rank_states: int = 0  # request states the parallel workers hold, all ranks (counted by worker_watch.py)
    workers_down: int = 0  # 1 while the parallel worker group is broken, until it restarts


class OutputStream:
    """One request's outputs: zero or more intermediate items, then exactly one final item."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._queue: "queue.Queue[DiffusionOutput]" = queue.Queue()

    def put(self, output: DiffusionOutput) -> None:
        self._queue.put(output)

    def get(self, timeout: Optional[float] = None) -> DiffusionOutput:
        return self._queue.get(timeout=timeout)

    def __iter__(self) -> Iterator[DiffusionOutput]:
        while True:
            item = self._queue.get()
            yield item
            if item.is_final:
                return

    def result(self, timeout: Optional[float] = None) -> DiffusionOutput:
        """Wait for and return the final output (intermediate ones are skipped)."""
        while True:
            item = self.get(timeout=timeout)
            if item.is_final:
                return item


class DiffusionEngine:
    """Owns the device through one busy-loop thread; everything else only enqueues."""

    def __init__(self, adapter, config: EngineConfig, scheduler: Optional[Scheduler] = None,
                 tick_listener: Optional[Callable[[TickStats], None]] = None, hooks: Optional[EngineHooks] = None,
                 *, run_loop: bool = True, float_outputs: bool = False):
        """`run_loop=False`: no busy-loop thread, the caller calls `step()`. `float_outputs`: the pipeline's
        float outputs instead of the declared dtypes (tests and benchmarks compare them before the rounding)."""
        self.adapter = adapter
        self.config = config
        self.mode = select_mode(config, adapter)
        self.inputs = adapter.input_schema(config)  # the one validation of every request
        self.clock = PhaseClock()  # the engine thread's phases (the runner's too); the sender adds its own
        hooks = hooks or EngineHooks()
        # Set (under _cond) when every request of the running tick is cancelled, or at close: the runner stops
        # that tick at its next block boundary instead of finishing a forward nobody waits for.
        self._interrupt = threading.Event()
        self._ticking: frozenset[str] = frozenset()  # the running tick's request ids (guarded by _cond)
        self.runner = ModelRunner(adapter, float_outputs=float_outputs, clock=self.clock,
                                  before_forward=hooks.before_forward, interrupt=self._interrupt,
                                  before_block=hooks.before_block)
        self.max_request_cost = config.scheduler.request_cost_limit(adapter.default_max_request_cost())
        self.scheduler = scheduler or self._make_scheduler()
        self._tick_listener = tick_listener
        self._tick_gate = hooks.tick_gate
        # Shared with callers' threads, guarded by _cond: scheduler, _sinks, _pending_aborts, _closed.
        self._cond = threading.Condition()
        self._sinks: dict[str, Sink] = {}
        self._pending_aborts: list[str] = []
        self._closed = False
        self.watch = WorkerWatch(adapter)  # the engine thread's own: the adapter's parallel workers, their restarts
        self._thread: Optional[threading.Thread] = None
        if run_loop:
            self._thread = threading.Thread(target=self._loop, name=f"engine-{adapter.name}", daemon=True)
            self._thread.start()
        logger.info("engine started: pipeline=%s mode=%s max_num_seqs=%d",
                    adapter.name, self.mode.value, config.scheduler.max_num_seqs)

    def _make_scheduler(self) -> Scheduler:
        key_fn = self.adapter.step_key if self.mode is EngineMode.STEP_BATCH else self.adapter.request_key
        return Scheduler(self.config.scheduler, key_fn, cost_fn=self.adapter.request_cost,
                         group_decodes=self.adapter.batched_decode)

    @classmethod
    def make_engine(cls, config: EngineConfig, adapter=None, tick_listener: Optional[Callable[[TickStats], None]] = None,
                    hooks: Optional[EngineHooks] = None) -> "DiffusionEngine":
        """Load the adapter (unless given), build the engine, start its thread, warm up.

        The adapter loads on a thread of its own that ends before the engine's starts. With
        libgomp every thread that runs torch CPU work keeps its own OpenMP team: one left on the
        caller's thread (Triton's stub runs `initialize` on its main thread) makes the process hold
        more OpenMP threads than cores, and then libgomp stops spinning between parallel regions,
        which slows every forward of the engine thread (docs/architecture.md). If loading or warm-up
        fails the error is re-raised (the engine closed).
        """
        if adapter is None:
            from engine_lib.pipelines.registry import load_adapter

            with ThreadPoolExecutor(1, thread_name_prefix="engine-load") as loader:  # its thread ends on exit
                adapter = loader.submit(load_adapter, config).result()
        engine = cls(adapter, config, tick_listener=tick_listener, hooks=hooks)
        try:
            if config.model.warmup:
                engine.warmup()
        except BaseException:
            engine.close()
            raise
        return engine

    @classmethod
    def wave(cls, adapter, config: EngineConfig, size: int, float_outputs: bool = False,
             hooks: Optional[EngineHooks] = None) -> "DiffusionEngine":
        """An engine without its thread for one offline request-mode wave (benchmarks, tests): up to `size`
        requests admitted together whatever their keys, each running to its end (`generate()`)."""
        return cls(adapter, config, Scheduler(SchedulerConfig(max_num_seqs=size), lambda params: None), hooks=hooks,
                   run_loop=False, float_outputs=float_outputs)

    def warmup(self, timeout: float = 600.0) -> None:
        """Run one small request through the real path, so the first user request is not the slow one."""
        steps = int(self.inputs.specs["num_inference_steps"].low or 1)  # the fewest steps the pipeline runs
        start = time.monotonic()
        inputs = {"prompt": "warm-up", "num_inference_steps": steps, **self.adapter.example_inputs()}
        waves = [1]
        compiled = getattr(getattr(self.adapter, "levers", None), "compiler", None) is not None
        if compiled and self.config.scheduler.max_num_seqs > 1:
            waves.append(2)  # compiled: a batch of one is specialised, so two rows compile the dynamic graph at load
        for size in waves:
            streams = [self.add_request(f"__warmup_{size}_{i}__", inputs) for i in range(size)]
            for final in [stream.result(timeout=timeout) for stream in streams]:
                if final.error is not None:
                    raise RuntimeError(f"warm-up failed: {final.error}") from final.error
        logger.info("engine warm-up done in %.2fs", time.monotonic() - start)

    # -- caller side (any thread) --------------------------------------------
    def parse(self, inputs: Mapping[str, Any]) -> SamplingParams:
        """Validate a request's inputs (by declared name) into SamplingParams; InvalidInputError names the input."""
        params = self.inputs.parse(inputs)
        budget, limit = self.config.scheduler.max_batch_tokens, self.max_request_cost
        cost = self.adapter.request_cost(params) if budget or limit else 0
        if budget and cost > budget:
            counts = "".join(f", {name}={params[name]}" for name in ("num_images", "num_frames") if name in params)
            raise InvalidInputError("height", f"{params.height}x{params.width}{counts} needs {cost} latent tokens per "
                                    f"step, more than max_batch_tokens={budget}")
        if limit and cost > limit:
            names = [name for name in ("height", "width", "num_frames", "num_images") if name in params]
            raise InvalidInputError(names[-1], f"{' x '.join(names)} = {' x '.join(str(params[n]) for n in names)} "
                                    f"costs {cost} latent tokens x rows per forward, above this model's "
                                    f"max_request_cost {limit}")
        return params

    def add_request(self, request_id: str, params: Union[SamplingParams, Mapping[str, Any]],
                    sink: Optional[Sink] = None, timeout_s: Optional[float] = None) -> Optional[OutputStream]:
        """Admit a request and return at once.

        `params` are the request's inputs: a mapping is validated here (`parse`);
        SamplingParams are taken as validated (the Triton edge parses first, to
        answer a bad request before it opens a stream).
        Without `sink` an OutputStream is returned; with one, every output is
        passed to `sink(output)` from the engine thread (it must not block).
        `timeout_s` (Triton's request timeout): a request not started by then ends
        with RequestTimedOutError and costs no device time; one already running
        runs to the end (the `deadline` policy tries to finish it in time). Its
        `priority` input orders admission (0: the default level).
        Raises InvalidInputError, EngineUnavailableError (closed, or `max_queue`
        requests already waiting), ValueError (duplicate active id).
        """
        if not isinstance(params, SamplingParams):
            params = self.parse(params)
        stream = None
        if sink is None:
            stream = OutputStream(request_id)
            sink = stream.put
        with self._cond:
            if self._closed:
                raise EngineUnavailableError("engine is shutting down")
            max_queue = self.config.limits.max_queue
            if self.scheduler.num_waiting >= max_queue:
                raise EngineUnavailableError(
                    f"queue full: {self.scheduler.num_waiting} requests waiting (max_queue={max_queue})")
            if request_id in self._sinks:
                raise ValueError(f"request id {request_id!r} is already active")
            request = DiffusionRequest(request_id, params,
                                       priority=params.get("priority") or self.config.scheduler.default_priority_level,
                                       num_steps=self.adapter.total_steps(params))
            if timeout_s:
                request.timeout_at = request.arrival_time + timeout_s
            self.scheduler.add_request(request)
            self._sinks[request_id] = sink
            self._cond.notify_all()
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Abort waiting or running requests: each ends with a final CANCELLED output
        and its runner state is freed by the busy loop at once (also when idle)."""
        with self._cond:
            self._pending_aborts.extend(request_ids)
            self._interrupt_if_all_cancelled()
            self._cond.notify_all()

    def _interrupt_if_all_cancelled(self) -> None:
        """Under _cond: stop the running tick once each of its requests is cancelled (one still wanted keeps
        it running to the step's end)."""
        if self._ticking and self._ticking <= set(self._pending_aborts):
            self._interrupt.set()

    def drop_stream(self, request_id: str) -> None:
        """The consumer went away: stop delivering to it. The request itself runs on and is cleaned up."""
        with self._cond:
            self._sinks.pop(request_id, None)

    def close(self, timeout: float = 5.0) -> None:
        """Reject new requests, end every open stream with UNAVAILABLE, join the thread."""
        with self._cond:
            if self._closed and not self._sinks:
                return
            self._closed = True
            self._interrupt.set()
            self._cond.notify_all()
        logger.info("engine shutting down")
        if self._thread is not None:
            self._thread.join(timeout)
        if self._loop_alive():
            logger.warning("engine thread still busy after %.1fs; its remaining outputs are dropped", timeout)
        with self._cond:
            sinks, self._sinks = self._sinks, {}
            self.scheduler.abort(list(sinks))
        for request_id, sink in sinks.items():
            self._deliver(sink, DiffusionOutput(request_id, 0, 0, True, error=EngineUnavailableError(
                "engine is shutting down")))
        if not self._loop_alive():
            self.runner.free(list(self.runner.states))
            close = getattr(self.adapter, "close", None)  # (test doubles have none)
            if close is not None:
                close()

    def stats(self) -> EngineStats:
        with self._cond:
            return EngineStats(self.scheduler.num_waiting, self.scheduler.num_running, self.runner.num_states,
                               len(self._sinks), self._loop_alive(), self.scheduler.waiting_by_priority(),
                               self.scheduler.num_preempted, self.clock.totals(),
                               {**self.watch.with_rank_counters(self.adapter.counters()),
                                "frames_generated": self.runner.frames_generated},
                               self.watch.rank_states, int(self.watch.down is not None))

    def _loop_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- busy loop (engine thread) -------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._pending_aborts or self.scheduler.has_requests
                           or self.watch.restart_due() or self.watch.check_due()):
                    self._cond.wait(self.watch.idle_wait_s())
                if self._closed:
                    return
                # idle: only the workers' liveness is due
                check_only = not (self._pending_aborts or self.scheduler.has_requests or self.watch.restart_due())
                aborted = self.scheduler.abort(self._pending_aborts)
                self._pending_aborts.clear()
                expired = self.scheduler.expire(time.monotonic())
                has_work = self.scheduler.has_requests  # else the tick only reports what ended
            for request in aborted:
                self.runner.free([request.request_id])
                self._emit_final(request, error=RequestCancelledError(f"request {request.request_id} cancelled"))
                logger.info("cancelled request %s", request.request_id)
            for request in expired:
                self._emit_final(request, error=request.error)
                logger.info("request %s timed out before it started", request.request_id)
            self._check_workers()  # (a worker that died since the last tick breaks the group here)
            if check_only:
                continue
            if self.watch.restart_due() and self.watch.restart() and self._closed:
                self.adapter.close()  # close() came during the start and did not wait for it: stop the new workers too
            self.watch.count_rank_states(idle=not has_work)
            if has_work and self._tick_gate is not None and not self._tick_gate():
                with self._cond:
                    self._cond.wait(timeout=0.01)
                continue
            try:
                self.step()
            except Exception:  # noqa: BLE001 - never let one tick kill the loop
                logger.exception("engine tick failed")
            self._check_workers()
            self.watch.count_rank_states(idle=not self.scheduler.has_requests)

    def step(self) -> tuple[SchedulerOutput, RunnerOutput]:
        """One tick: schedule, execute (one denoise step), update the scheduler, emit the outputs. The busy loop
        calls it; call it yourself only on an engine built with `run_loop=False` (the runner has one owner).

        Returns the tick's plan and what the runner did in it (empty when nothing was scheduled, the tick was
        interrupted, or the engine is closed); the outputs themselves go to the requests' streams."""
        with self._cond:
            if self._closed:
                return SchedulerOutput(), RunnerOutput()
            with self.clock.phase("schedule"):
                sched_out = self.scheduler.schedule()
                new = [self.scheduler.get_request(i) for i in sched_out.new_ids]
                running = [self.scheduler.get_request(i) for i in sched_out.running_ids]
            if sched_out.retry_after_s:  # a burst is still arriving: wait for it (an arrival wakes us)
                self._cond.wait(timeout=sched_out.retry_after_s)
            self._ticking = frozenset(r.request_id for r in new + running)
            self._interrupt.clear()
            self._interrupt_if_all_cancelled()  # cancelled since the loop applied the aborts
        self.runner.free(sched_out.finished_ids)
        self.runner.pause(sched_out.preempted_ids)
        if sched_out.is_empty:
            return sched_out, RunnerOutput()
        start = time.monotonic()
        try:
            if self.watch.down is not None:  # its requests end at once, rather than wait for an unknown time
                raise EngineUnavailableError(f"{self.adapter.name}'s parallel workers are down ({self.watch.down}); "
                                             "they restart by themselves: retry later")
            result = self.runner.execute_step(new, running, frozenset(sched_out.hold_decode_ids))
        except TickInterrupted:  # each of its requests was cancelled (their finals follow), or the engine closes
            logger.info("tick interrupted after %.2fs (its requests were cancelled, or the engine closes)",
                        time.monotonic() - start)
            self.runner.free([r.request_id for r in new + running])
            return sched_out, RunnerOutput()
        except Exception as exc:  # noqa: BLE001 - fail this tick's requests, keep the loop
            result = RunnerOutput()
            for request in new + running:
                logger.warning("request %s failed: %s", request.request_id, result.fail(request.request_id, exc))
            self.runner.free([r.request_id for r in new + running])
        seconds = time.monotonic() - start
        with self._cond, self.clock.phase("schedule"):
            self.scheduler.observe_tick(seconds, sched_out)
            ended = self.scheduler.update_from_output(sched_out, result)
        if self._tick_listener is not None:  # before the outputs: whoever reads a tick's final output sees it
            self._tick_listener(TickStats(self.mode, result.forward_size, seconds, result.batch_retries))
        with self.clock.phase("emit"):
            self._emit(new + running, ended, result)
        return sched_out, result

    def generate(self, inputs: Mapping[str, Union[SamplingParams, Mapping[str, Any]]]) -> dict[str, DiffusionOutput]:
        """Offline, as nano-vllm's `generate()` (an engine built with `run_loop=False`): admit every request
        (request id -> inputs), step until each has ended, and return each one's final output."""
        finals: dict[str, DiffusionOutput] = {}

        def keep_final(output: DiffusionOutput) -> None:
            if output.is_final:
                finals[output.request_id] = output

        for request_id, params in inputs.items():
            self.add_request(request_id, params, sink=keep_final)
        while self.scheduler.has_requests:
            self.step()
        return finals

    # -- the adapter's parallel workers (engine thread) ------------------------------
    def _check_workers(self) -> None:
        """When the adapter's worker group broke (a worker died, or a call timed out), every request whose
        state the engine holds (running or paused: what the ranks held is lost) ends with one final error, and
        the group restarts before the next tick (worker_watch.py); the requests still waiting run on the new group."""
        broken = self.watch.broke()
        if broken is None:
            return
        error = PipelineError(f"the model's parallel workers failed: {broken}")
        with self._cond:
            lost = self.scheduler.abort(list(self.runner.states))
        self.runner.free(list(self.runner.states))
        for request in lost:
            request.status, request.error = RequestStatus.FAILED, error
            self._emit_final(request, error=error)
        logger.error("%s's parallel workers failed (%s): %d request(s) lost; restarting them", self.adapter.name,
                     broken, len(lost))

    # -- output streams --------------------------------------------------------
    def _emit(self, scheduled: list[DiffusionRequest], ended: list[DiffusionRequest], result: RunnerOutput) -> None:
        ended_ids = {r.request_id for r in ended}
        for request in scheduled:
            chunk = result.chunks.get(request.request_id)  # streamed even in the tick its request ends
            preview = result.previews.get(request.request_id) if request.request_id not in ended_ids else None
            if chunk is not None or preview is not None:
                self._emit_output(DiffusionOutput(request.request_id, request.step_index, request.num_steps,
                                                  False, outputs=chunk if chunk is not None else preview))
        for request in ended:
            self._emit_final(request, outputs=result.outputs.get(request.request_id), error=request.error)

    def _emit_final(self, request: DiffusionRequest, outputs: Optional[dict] = None,
                    error: Optional[EngineError] = None) -> None:
        step = request.num_steps if error is None else request.step_index
        self._emit_output(DiffusionOutput(request.request_id, step, request.num_steps, True,
                                          outputs=outputs or {}, error=error))

    def _emit_output(self, output: DiffusionOutput) -> None:
        with self._cond:
            sink = self._sinks.pop(output.request_id, None) if output.is_final else self._sinks.get(output.request_id)
        if sink is not None:
            self._deliver(sink, output)

    @staticmethod
    def _deliver(sink: Sink, output: DiffusionOutput) -> None:
        try:
            sink(output)
        except Exception:  # noqa: BLE001 - a broken consumer must not break the engine
            logger.exception("output sink for %s failed", output.request_id)

