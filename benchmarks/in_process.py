"""A system's engine in this process, behind the load generator's Target surface: no tritonserver, no gRPC.

For the lent GPU machine, where no tritonserver runs (it has no Triton and cannot install one:
docs/benchmarks.md "GPU"), and on this CPU as a cross-check of the served numbers. The engine is the
served one: the same `EngineConfig` parameters a system's
config.pbtxt would carry, `DiffusionEngine.make_engine`, requests parsed by the pipeline's own
input schema. Only the transport is missing.

```
system = InProcessSystem(systems.default_systems(device="cuda")[3], model_path)  # loads the weights once
with system.running() as running:                  # a fresh engine (and its thread) over them
    loadgen.run_closed_loop(running.target, specs, 8)
    running.tally.stats()                          # what systems.batch_stats reads off a server
```

One engine at a time: each point gets a fresh engine over the loaded adapter and closes it after,
so only one engine thread does torch work (with libgomp a second thread's OpenMP team slows the
first: benchmarks/efficiency.py).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from benchmarks.loadgen import DEFAULT_TIMEOUT_S, RequestRecord, spec_values
from benchmarks.systems import System


class EngineSession:
    """One virtual client of an in-process engine: one request in flight, its outputs read off its stream."""

    def __init__(self, engine, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.engine = engine
        self.timeout_s = timeout_s

    def run(self, record: RequestRecord) -> RequestRecord:
        """Fill `record` as StreamingSession does: progress and previews, then exactly one final output."""
        record.sent = time.perf_counter()
        inputs = {name: value for name, _, value in spec_values(record.spec)}
        # Triton's request timeout, as the gRPC client sends it: the time left at the send.
        timeout = None if record.deadline is None else max(1e-6, record.deadline - record.sent)
        try:
            stream = self.engine.add_request(record.request_id, inputs, timeout_s=timeout)
        except Exception as exc:  # noqa: BLE001 - a refused request is this request's error
            record.error, record.done = f"send failed: {exc}", time.perf_counter()
            return record
        give_up = record.sent + self.timeout_s
        while True:
            try:
                output = stream.get(timeout=max(0.0, give_up - time.perf_counter()))
            except queue.Empty:
                self.engine.abort([record.request_id])
                record.error = f"no final output within {self.timeout_s:.0f} s"
                return record
            now = time.perf_counter()
            record.num_responses += 1
            record.first_response = record.first_response or now
            if not output.is_final:
                if output.outputs and record.first_preview is None:
                    record.first_preview = now
                continue
            record.done, record.num_final_flags, record.num_final_outputs = now, 1, 1
            if output.error is not None:
                record.error = str(output.error)
            else:
                image = output.outputs.get("image", output.outputs.get("video"))
                record.image_shape = None if image is None else tuple(int(d) for d in image.shape)
            return record

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class EngineTarget:
    """loadgen.Target's surface over an in-process engine: `open()` gives a session."""

    engine: object  # engine_lib.engine.DiffusionEngine
    timeout_s: float = DEFAULT_TIMEOUT_S

    def open(self) -> EngineSession:
        return EngineSession(self.engine, self.timeout_s)


@dataclass
class TickTally:
    """The engine's tick listener: what the served benchmark reads off diffusion_batch_size and friends."""

    ticks: int = 0
    rows: int = 0
    seconds: float = 0.0
    retries: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __call__(self, tick) -> None:  # engine_lib.engine.TickStats
        with self._lock:
            self.ticks += 1
            self.rows += tick.batch_size
            self.seconds += tick.seconds
            self.retries += tick.batch_retries

    def reset(self) -> None:
        with self._lock:
            self.ticks = self.rows = self.retries = 0
            self.seconds = 0.0

    def stats(self) -> dict:
        """systems.batch_stats' fields: mean requests per forward, device-busy seconds, batches retried."""
        with self._lock:
            if not self.ticks:
                return {}
            return {"mean_batch_size": self.rows / self.ticks, "ticks": self.ticks, "device_busy_s": self.seconds,
                    "batch_retries": self.retries}


@dataclass
class RunningEngine:
    system: System
    target: EngineTarget
    tally: TickTally


class InProcessSystem:
    """A system's pipeline loaded (as its model's `initialize` would); `running()` puts an engine over it.

    `shared` (a dict the caller keeps): systems whose adapters keep the same options
    (registry.adapter_options) share one loaded adapter, as only one engine runs at a time.
    """

    def __init__(self, system: System, model_path: Path, shared: Optional[dict] = None):
        from engine_lib.config import EngineConfig
        from engine_lib.pipelines.registry import adapter_options, load_adapter

        self.system = system
        self.config = EngineConfig.from_parameters(
            {"pipeline": system.model, "model_path": str(model_path), **system.parameters})
        shared = {} if shared is None else shared
        key = (self.config.pipeline, self.config.device, self.config.dtype, str(model_path),
               tuple(sorted(adapter_options(self.config, str(model_path)).items())))
        if key not in shared:
            with ThreadPoolExecutor(1, thread_name_prefix="load") as loader:  # as make_engine: its thread ends
                shared[key] = loader.submit(load_adapter, self.config).result()
        self.adapter = shared[key]

    @contextlib.contextmanager
    def running(self) -> Iterator[RunningEngine]:
        """A fresh engine (warmed up when the system says so) over the loaded adapter, closed on exit."""
        from engine_lib.engine import DiffusionEngine

        tally = TickTally()
        engine = DiffusionEngine.make_engine(self.config, self.adapter, tick_listener=tally)
        tally.reset()  # only the measured requests count (the engine reports a tick before its outputs)
        try:
            yield RunningEngine(self.system, EngineTarget(engine), tally)
        finally:
            engine.close()
