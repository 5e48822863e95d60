"""Custom Prometheus metrics of one model, served on Triton's /metrics port.

Hot paths (the engine's tick listener, the sender thread) only put plain
numbers on a queue; this module's own thread applies them to
`pb_utils.MetricFamily` metrics (each update is a round trip to tritonserver)
and samples the engine's counters (`engine.stats()`) twice a second, so the
waiting/running gauges and the runner-state count are visible to operators and
tests. Every metric carries the labels `model` and `instance` (Triton's instance name, e.g.
`qwen_image_0_1`): each instance runs its own engine, and two instances must never share a
series (Triton's core frees a shared one twice when the first instance unloads).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Callable, Optional

from engine_lib.phases import PHASES

# invalid: refused at admission for its inputs; unavailable: refused because the queue was full or the
# engine was shutting down; timed_out: its deadline (Triton's request timeout) passed before it started.
# None of these three ran.
OUTCOMES = ("success", "error", "cancelled", "invalid", "unavailable", "timed_out")
SECONDS_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64]

# (name, description) of each gauge and the EngineStats field it shows.
GAUGES = {
    "num_waiting": ("diffusion_requests_waiting", "Requests admitted and waiting for the engine"),
    "num_running": ("diffusion_requests_running", "Requests the engine is running"),
    "num_runner_states": ("diffusion_runner_states", "Per-request step states the runner holds"),
    "num_streams": ("diffusion_open_streams", "Engine output streams still open"),
    "num_rank_states": ("diffusion_rank_states", "Request states the parallel workers hold, all ranks (counted when the "
                        "engine goes idle and every second while it runs; 0 without workers)"),
    "workers_down": ("diffusion_parallel_workers_down", "1 while the model's parallel worker group is broken (a rank "
                     "died or sent no heartbeat), until it restarts; 0 without workers; `serve ready` says not "
                     "ready meanwhile"),
}
HISTOGRAMS = {
    "batch_size": ("diffusion_batch_size", "Requests per engine tick in its denoise forward (requests only "
                   "waiting for a grouped decode not counted)", BATCH_BUCKETS),
    "tick_seconds": ("diffusion_tick_seconds", "Device time of one engine tick (one denoise step of the running batch)",
                     SECONDS_BUCKETS),
    "first_response_seconds": ("diffusion_time_to_first_response_seconds",
                               "From execute() to a request's first response", SECONDS_BUCKETS),
    "latency_seconds": ("diffusion_request_latency_seconds",
                        "From execute() to a request's final response (successes and errors)", SECONDS_BUCKETS),
}


def _env_int(name: str) -> int:
    try:
        return int(os.environ.get(name, "0") or 0)
    except ValueError:
        return 0


class ModelMetrics:
    """Records from any thread without blocking; applies on its own thread."""

    _STOP = object()

    def __init__(self, pb_utils: Any, model_name: str, stats: Optional[Callable[[], Any]] = None,
                 log: Callable[[str], None] = print, sample_interval_s: float = 0.5, instance: str = "",
                 priority_levels: int = 0):
        self._stats = stats
        self._log = log
        self._sample_interval_s = sample_interval_s
        self._queue: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        labels = {"model": model_name, "instance": instance or model_name}
        family = pb_utils.MetricFamily
        # Families must outlive their metrics (the Python backend checks), so both are kept.
        self._families = []

        def make(name: str, description: str, kind: Any):
            self._families.append(family(name=name, description=description, kind=kind))
            return self._families[-1]

        requests = make("diffusion_requests_total", "Requests by outcome: " + ", ".join(OUTCOMES), family.COUNTER)
        self._outcomes = {o: requests.Metric(labels={**labels, "outcome": o}) for o in OUTCOMES}
        self._gauges = {field: make(name, text, family.GAUGE).Metric(labels=labels)
                        for field, (name, text) in GAUGES.items()}
        self._histograms = {key: make(name, text, family.HISTOGRAM).Metric(labels=labels, buckets=buckets)
                            for key, (name, text, buckets) in HISTOGRAMS.items()}
        by_priority = make("diffusion_requests_waiting_by_priority", "Requests waiting, by priority level "
                           "(1: most urgent)", family.GAUGE)
        self._waiting_by_priority = {level: by_priority.Metric(labels={**labels, "priority": str(level)})
                                     for level in range(1, priority_levels + 1)}
        self._batch_retries = make("diffusion_batch_retries_total", "Batched denoise forwards that failed and "
                                   "ran again one request at a time", family.COUNTER).Metric(labels=labels)
        self._preemptions = make("diffusion_preemptions_total", "Times a running request was paused between "
                                 "steps for a more urgent one", family.COUNTER).Metric(labels=labels)
        phases = make("diffusion_engine_phase_seconds_total", "Seconds the engine thread (and the sender, phases "
                      "encode and send) spent per phase", family.COUNTER)
        cache_steps = make("diffusion_cache_steps_total", "Step cache decisions, one per request and CFG branch at "
                           "each step of a request that caches: computed (every block ran) or reused (first_block: "
                           "the step left after the first block; taylorseer: attention predicted)",
                           family.COUNTER)
        # Counters that follow monotone totals of the engine's stats: (stats field, key) -> metric.
        self._totals = {("num_preempted", None): self._preemptions,
                        **{("phase_seconds", phase): phases.Metric(labels={**labels, "phase": phase})
                           for phase in PHASES},
                        **{("counters", f"prompt_cache_{kind}"): make(
                            f"diffusion_prompt_cache_{kind}_total", f"Prompt embeddings {text}",
                            family.COUNTER).Metric(labels=labels)
                           for kind, text in (("hits", "reused from the cache"), ("misses", "encoded"))},
                        **{("counters", f"cache_steps_{outcome}"): cache_steps.Metric(
                            labels={**labels, "outcome": outcome}) for outcome in ("computed", "reused")},
                        ("counters", "frames_generated"): make(
                            "diffusion_frames_generated_total", "Video frames generated (finished requests of video "
                            "pipelines)", family.COUNTER).Metric(labels=labels),
                        ("counters", "compile_recompiles"): make(
                            "diffusion_compile_recompiles_total", "Times torch.compile compiled a compiled part of "
                            "the model again after a guard failed (a new shape that was not dynamic, a changed "
                            "module); 0 without compile", family.COUNTER).Metric(labels=labels)}
        self._totals_seen = dict.fromkeys(self._totals, 0.0)
        self._labels, self._weights = labels, []
        self._weights_family = make("diffusion_weight_bytes", "Bytes of each component's weights (parameters and "
                                    "buffers; a quantized weight counts its data and scales)", family.GAUGE)
        # Set once: the launcher's supervisor starts each server with its restart count so far.
        self._restarts = make("diffusion_server_restarts", "Times the launcher restarted this tritonserver after "
                              "it or a Python stub died", family.GAUGE).Metric(labels=labels)
        self._restarts.set(float(_env_int("DIFFUSION_SERVER_RESTARTS")))
        self._thread = threading.Thread(target=self._run, name=f"{model_name}-metrics", daemon=True)

    def weight_bytes(self, by_component: dict) -> None:
        """Set once at load, before `start`: the bytes each component's weights hold (quantized: their int8/fp8 data
        and scales)."""
        gauge = self._weights_family
        self._weights = [gauge.Metric(labels={**self._labels, "component": name}) for name in by_component]
        for metric, value in zip(self._weights, by_component.values()):
            metric.set(float(value))

    def start(self, stats: Optional[Callable[[], Any]] = None) -> None:
        if stats is not None:
            self._stats = stats
        self._thread.start()

    # -- hot-path recorders: plain numbers onto the queue ----------------------------
    def tick(self, tick_stats: Any) -> None:
        """The engine's tick listener (engine thread)."""
        if tick_stats.batch_retries:  # applied before the tick's batch size: who sees that sees these
            self._queue.put(("retries", tick_stats.batch_retries))
        self._queue.put(("observe", "batch_size", float(tick_stats.batch_size)))
        self._queue.put(("observe", "tick_seconds", float(tick_stats.seconds)))

    def request_done(self, outcome: str, latency_s: Optional[float]) -> None:
        self._queue.put(("outcome", outcome, latency_s))

    def first_response(self, seconds: float) -> None:
        self._queue.put(("observe", "first_response_seconds", float(seconds)))

    # -- applying thread --------------------------------------------------------------
    def _run(self) -> None:
        next_sample = 0.0
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, next_sample - time.monotonic()))
            except queue.Empty:
                item = None
            if item is not None and item[0] is self._STOP:
                return
            try:
                if item is not None:
                    self._apply(item)
                if time.monotonic() >= next_sample:
                    self._sample()
                    next_sample = time.monotonic() + self._sample_interval_s
            except Exception as exc:  # noqa: BLE001 - metrics must never take the model down
                self._log(f"metrics update failed: {exc!r}")

    def _apply(self, item: tuple) -> None:
        if item[0] == "observe":
            self._histograms[item[1]].observe(item[2])
        elif item[0] == "retries":
            self._batch_retries.increment(float(item[1]))
        elif item[0] == "outcome":
            _, outcome, latency = item
            self._outcomes[outcome].increment(1)
            if latency is not None:
                self._histograms["latency_seconds"].observe(latency)

    def _sample(self) -> None:
        if self._stats is None:
            return
        stats = self._stats()
        waiting = getattr(stats, "waiting_by_priority", None) or {}
        for level, gauge in self._waiting_by_priority.items():  # before the total: who sees it sees these
            gauge.set(float(waiting.get(level, 0)))
        for field, gauge in self._gauges.items():
            gauge.set(float(getattr(stats, field)))
        for (field, key), counter in self._totals.items():
            value = getattr(stats, field, None)
            value = float((value or {}).get(key, 0.0) if key is not None else (value or 0))
            if value > self._totals_seen[(field, key)]:
                counter.increment(value - self._totals_seen[(field, key)])
                self._totals_seen[(field, key)] = value

    def close(self, timeout_s: float = 2.0) -> None:
        """Apply what is queued, then release metrics before their families."""
        if self._thread.is_alive():
            self._queue.put((self._STOP,))
            self._thread.join(timeout_s)
        try:
            self._sample()  # final gauges: what the closed engine still holds
        except Exception as exc:  # noqa: BLE001
            self._log(f"metrics update failed: {exc!r}")
        self._outcomes, self._gauges, self._histograms, self._restarts, self._weights = {}, {}, {}, None, []
        self._waiting_by_priority, self._preemptions, self._batch_retries, self._totals = {}, None, None, {}
        self._families = []
