"""Load generator: closed-loop concurrency and open-loop Poisson arrivals over tritonclient gRPC.

Each virtual client owns one connection with at most one request in flight: a `StreamClient` (one gRPC stream, so
an error response, which carries no request id, belongs to the one request in flight) for the decoupled models, an
`InferClient` (plain `infer`) for the baseline. A request counts as completed only with exactly one is_final
response, exactly one Triton FINAL flag, nothing after it, and an image of the shape it asked for.
"""

from __future__ import annotations

import functools
import itertools
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from benchmarks.workloads import RequestSpec, input_image
from client.grpc_transport import stop_stream

DEFAULT_TIMEOUT_S = 900.0
# The DIFFUSION_PRIORITY_KEY of the servers the benchmarks start (systems.serve): a request more urgent than the
# model's default level carries it as its `priority_key` parameter, or the model refuses it.
PRIORITY_KEY = "bench-priority-key"


@dataclass
class RequestRecord:
    """What happened to one request; times are time.perf_counter() seconds."""

    request_id: str
    spec: RequestSpec
    scheduled: float = 0.0  # arrival time (open loop) or send time (closed loop)
    sent: float = 0.0
    first_response: Optional[float] = None
    first_preview: Optional[float] = None
    done: Optional[float] = None
    num_responses: int = 0
    num_final_flags: int = 0  # Triton's triton_final_response flag
    num_final_outputs: int = 0  # responses whose is_final output is true
    late_responses: int = 0  # responses that arrived after the FINAL flag
    image_shape: Optional[tuple] = None
    image: Optional[np.ndarray] = field(default=None, repr=False)  # the final output, for comparing runs
    error: Optional[str] = None
    deadline: Optional[float] = None  # sent as Triton's request timeout (the time left at the send; gRPC streams)

    @property
    def ok(self) -> bool:
        return self.error is None and self.check_error() is None

    def check_error(self) -> Optional[str]:
        """Why this request does not count as a correct completion (None when it does)."""
        if self.error is not None:
            return self.error
        if self.num_final_flags != 1:
            return f"{self.num_final_flags} FINAL flags"
        if self.num_final_outputs != 1:
            return f"{self.num_final_outputs} responses with is_final=true"
        if self.late_responses:
            return f"{self.late_responses} responses after FINAL"
        want = ((1, self.spec.num_frames) if self.spec.num_frames else (self.spec.num_images,)) + (
            self.spec.height, self.spec.width, 3)
        if self.image_shape != want:
            return f"image shape {self.image_shape}, expected {want}"
        return None

    @property
    def latency(self) -> Optional[float]:
        return None if self.done is None else self.done - self.scheduled


TRITON_DTYPES = {"BYTES": np.object_, "INT32": np.int32, "INT64": np.int64, "FP32": np.float32}


def spec_values(spec: RequestSpec, streaming: bool = True) -> list[tuple[str, str, object]]:
    """A spec's inputs as (name, Triton datatype, Python value), for gRPC or perf_analyzer.
    The streaming models' optional inputs are sent only when not at their defaults (not every pipeline declares
    them); the baseline takes the five basic ones."""
    values = [("prompt", "BYTES", spec.prompt), ("height", "INT32", spec.height), ("width", "INT32", spec.width),
              ("num_inference_steps", "INT32", spec.steps), ("seed", "INT64", spec.seed)]
    if streaming:
        optional = (("num_images", "INT32", spec.num_images, 1), ("lora_name", "BYTES", spec.lora_name, ""),
                    ("preview_interval", "INT32", spec.preview_interval, 0), ("priority", "INT32", spec.priority, 0),
                    ("num_frames", "INT32", spec.num_frames, 0))
        values += [(name, dtype, value) for name, dtype, value, default in optional if value != default]
        if spec.cache:
            values += [("cache", "BYTES", spec.cache), ("cache_threshold", "FP32", spec.cache_threshold)]
        if spec.image_seed:
            values += [("image", "BYTES", input_image(spec.image_seed, spec.height, spec.width)),
                       ("strength", "FP32", spec.strength)]
    return values


def infer_inputs(spec: RequestSpec, streaming: bool, batch_dim: bool = False) -> list:
    """tritonclient InferInputs for a spec; the baseline (batch_dim) takes [1, 1] tensors and no previews."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, dtype, value in spec_values(spec, streaming):
        array = np.array([value.encode() if isinstance(value, str) else value], dtype=TRITON_DTYPES[dtype])
        if batch_dim:
            array = array.reshape(1, 1)
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


class InferClient:
    """Plain (non-decoupled) gRPC inference, as a client of the naive baseline does it."""

    def __init__(self, url: str, model: str, timeout_s: float = DEFAULT_TIMEOUT_S):
        import tritonclient.grpc as grpcclient

        self.model = model
        self.timeout_s = timeout_s
        self._client = grpcclient.InferenceServerClient(url)

    def run(self, record: RequestRecord) -> RequestRecord:
        record.sent = time.perf_counter()
        try:
            result = self._client.infer(self.model, infer_inputs(record.spec, streaming=False, batch_dim=True),
                                        request_id=record.request_id, client_timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001
            record.error, record.done = str(exc), time.perf_counter()
            return record
        record.done = record.first_response = time.perf_counter()
        record.num_responses = record.num_final_flags = record.num_final_outputs = 1
        record.image_shape = tuple(int(d) for d in result.as_numpy("image").shape)
        return record

    def close(self) -> None:
        self._client.close()


class StreamClient(InferClient):
    """One gRPC stream to a decoupled model, on InferClient's connection."""

    def __init__(self, url: str, model: str, timeout_s: float = DEFAULT_TIMEOUT_S):
        super().__init__(url, model, timeout_s)
        self._responses: "queue.Queue[tuple]" = queue.Queue()
        self._previous: Optional[RequestRecord] = None
        self._client.start_stream(callback=self._on_response)

    def _on_response(self, result, error) -> None:
        self._responses.put((time.perf_counter(), result, error))

    def _fail(self, record: RequestRecord, error: str, done: Optional[float] = None) -> RequestRecord:
        """The request ends with `error`, and the stream starts clean (an error response has no request id)."""
        record.error, record.done = error, done
        stop_stream(self._client, cancel=True)
        self._responses = queue.Queue()
        self._client.start_stream(callback=self._on_response)
        return record

    def _drain_late(self) -> None:
        """Responses still queued belong to the previous request: they arrived after its FINAL (this thread is the
        queue's one reader)."""
        while not self._responses.empty():
            self._responses.get_nowait()
            if self._previous is not None:
                self._previous.late_responses += 1

    def run(self, record: RequestRecord) -> RequestRecord:
        self._drain_late()
        self._previous = record
        record.sent = time.perf_counter()
        try:
            timeout = {} if record.deadline is None else {
                "timeout": max(1, int((record.deadline - record.sent) * 1e6))}  # microseconds
            self._client.async_stream_infer(self.model, infer_inputs(record.spec, streaming=True),
                                            request_id=record.request_id, enable_empty_final_response=True,
                                            parameters={"priority_key": PRIORITY_KEY} if record.spec.priority else None,
                                            **timeout)
        except Exception as exc:  # noqa: BLE001 - any client failure is this request's error
            return self._fail(record, f"send failed: {exc}")
        deadline = record.sent + self.timeout_s
        while True:
            try:
                t, result, error = self._responses.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                return self._fail(record, f"no FINAL within {self.timeout_s:.0f} s")
            if error is not None:
                return self._fail(record, str(error), t)
            if self._handle(record, t, result):
                return record

    @staticmethod
    def _handle(record: RequestRecord, t: float, result) -> bool:
        """Account one response; True once the FINAL flag arrived."""
        response = result.get_response()
        if response.id != record.request_id:
            return False  # a stray from an earlier request on this stream
        record.num_responses += 1
        if record.first_response is None:
            record.first_response = t
        names = {out.name for out in response.outputs}
        is_final = bool(result.as_numpy("is_final").reshape(-1)[0]) if "is_final" in names else False
        output = "image" if "image" in names else "video" if "video" in names else None
        if output is not None:  # an image, a video, or a video's chunk
            if is_final:
                record.image = result.as_numpy(output)
                record.image_shape = tuple(int(d) for d in record.image.shape)
            elif record.first_preview is None:
                record.first_preview = t
        if is_final:
            record.num_final_outputs += 1
        params = response.parameters
        if "triton_final_response" in params and params["triton_final_response"].bool_param:
            record.num_final_flags += 1
            record.done = t
            return True
        return False

    def close(self) -> None:
        self._drain_late()
        # A held stream keeps tritonserver 2.51 from shutting down: always stop it (without tritonclient's
        # leaked thread: a cancelled stream's request iterator otherwise waits for the life of the process).
        stop_stream(self._client, cancel=True)
        super().close()


@dataclass(frozen=True)
class Target:
    """Where and how to send: a model on a server, streaming (decoupled) or not."""

    url: str
    model: str
    streaming: bool = True
    timeout_s: float = DEFAULT_TIMEOUT_S

    def open(self):
        return (StreamClient if self.streaming else InferClient)(self.url, self.model, self.timeout_s)


@dataclass
class RunResult:
    """The records of one closed- or open-loop run, with its wall-clock span."""

    kind: str  # "closed" or "open"
    records: list[RequestRecord]
    concurrency: Optional[int] = None
    offered_rate: Optional[float] = None


def _ids(tag: str) -> Iterable[str]:
    return (f"{tag}-{i}" for i in itertools.count())


def run_closed_loop(target: Target, specs: Iterable[RequestSpec], concurrency: int, tag: str = "c",
                    pause_s: float = 0.0) -> RunResult:
    """`concurrency` virtual clients each send their next request `pause_s` after the last one ends, until `specs`
    (which may be an endless generator that the caller stops) runs out."""
    clients = [target.open() for _ in range(concurrency)]
    records: list[RequestRecord] = []

    def send(client, job: tuple[str, RequestSpec]) -> None:
        record = RequestRecord(*job)
        records.append(record)
        record.scheduled = time.perf_counter()
        client.run(record)
        time.sleep(pause_s)

    try:
        share(zip(_ids(tag), specs), [functools.partial(send, client) for client in clients])
    finally:
        for client in clients:
            client.close()
    return RunResult("closed", records, concurrency=concurrency)


def share(jobs: Iterable, workers: Sequence[Callable[[Any], None]]) -> None:
    """Each worker, in a thread of its own, takes the next job as soon as it is done with the last, until none is
    left (a closed loop); the first error of any is raised here."""
    jobs, lock = iter(jobs), threading.Lock()

    def take_turns(work) -> None:
        while True:
            with lock:
                job = next(jobs, None)
            if job is None:
                return
            work(job)

    _run_threads([functools.partial(take_turns, work) for work in workers])


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """n arrival offsets (seconds from the start) of a Poisson process of `rate` per second."""
    rng = random.Random(seed)
    return list(itertools.accumulate(rng.expovariate(rate) for _ in range(n)))


def run_open_loop(target: Target, specs: Sequence[RequestSpec], rate: float, seed: int = 0,
                  max_outstanding: int = 32, tag: str = "p", slo_s: Optional[dict] = None) -> RunResult:
    """Poisson arrivals at `rate` requests/s; latency counts from the arrival, not the send.

    A pool of `max_outstanding` clients carries the requests; if all are busy a request waits (and that wait is part of
    its latency, as it would be for users). `slo_s` (shape key -> seconds): each request's deadline is its arrival plus
    its SLO, sent as Triton's request timeout.
    """
    offsets = poisson_arrivals(len(specs), rate, seed)
    clients = [target.open() for _ in range(min(max_outstanding, len(specs)))]
    records = [RequestRecord(rid, spec) for rid, spec in zip(_ids(tag), specs)]

    def arrivals() -> Iterator[RequestRecord]:
        """Each record at its arrival time, to the first free client (`share` holds its lock meanwhile)."""
        start = time.perf_counter() + 0.05
        for record, offset in zip(records, offsets):
            record.scheduled = start + offset
            if slo_s is not None:
                record.deadline = record.scheduled + slo_s[record.spec.shape_key]
            time.sleep(max(0.0, record.scheduled - time.perf_counter()))
            yield record

    try:
        share(arrivals(), [client.run for client in clients])
    finally:
        for client in clients:
            client.close()
    return RunResult("open", records, offered_rate=rate)


def _run_threads(bodies: Sequence[Callable[[], None]]) -> None:
    errors: list[BaseException] = []

    def wrap(body):
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(b,), daemon=True) for b in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def summarize(run: RunResult, solo_latency: Optional[dict] = None, slo_factor: float = 3.0) -> dict:
    """Throughput, latency percentiles, time to first preview, SLO attainment and errors of a run.

    SLO: a request meets it when it completes correctly within slo_factor x the solo latency of its shape and step count
    (`solo_latency[spec.shape_key]`). Errors count as misses.
    """
    ok = [r for r in run.records if r.ok]
    errors = [r for r in run.records if not r.ok]
    latencies = [r.latency for r in ok]
    span = max(r.done for r in ok) - min(r.scheduled for r in run.records) if ok else None
    previews = [r.first_preview - r.scheduled for r in ok if r.first_preview is not None]
    firsts = [r.first_response - r.scheduled for r in ok if r.first_response is not None]
    out = {"kind": run.kind, "concurrency": run.concurrency, "offered_rate": run.offered_rate,
           "requests": len(run.records), "completed": len(ok), "errors": len(errors),
           "timed_out": sum(1 for r in errors if "timed out" in (r.error or "")),  # deadline passed before it started
           "error_examples": sorted({r.check_error() for r in errors})[:3], "duration_s": span,
           "requests_per_s": (len(ok) / span) if span else None,
           "images_per_s": (sum(r.spec.num_images for r in ok) / span) if span else None,
           "latency_mean_s": float(np.mean(latencies)) if latencies else None,
           **{f"latency_p{q}_s": percentile(latencies, q) for q in (50, 95, 99)},
           "first_response_p50_s": percentile(firsts, 50), "first_preview_p50_s": percentile(previews, 50),
           "latencies_s": latencies}
    if solo_latency:
        def meets(r: RequestRecord) -> bool:
            return r.ok and r.latency <= slo_factor * solo_latency[r.spec.shape_key]

        out["slo_attainment"] = sum(map(meets, run.records)) / len(run.records) if run.records else None
        by_shape: dict[str, list[bool]] = {}
        for r in run.records:
            by_shape.setdefault(r.spec.shape_key, []).append(meets(r))
        out["slo_by_shape"] = {k: {"requests": len(v), "attainment": sum(v) / len(v)} for k, v in by_shape.items()}
    return out
