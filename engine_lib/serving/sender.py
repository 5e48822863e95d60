"""The one thread that does every `response_sender.send()` and polls cancellation.

A send is a blocking round trip to tritonserver, so neither `execute()` nor the
engine's busy loop may do it. Everything reaches this thread through one FIFO
queue: a stream is opened before its request enters the engine, so its outputs
always find it. Every request ends with exactly one FINAL-flagged response: its
final output, its error, CANCELLED after a client cancel, or UNAVAILABLE when
the sender stops with the stream still open.

Encoding a response (`output_format` png or mp4) runs on a small pool beside this
thread: an mp4 of a long video takes seconds, and no other stream's responses (or
cancel polling) should wait for it. A stream's responses still go out in the
order the engine made them: one waits while an earlier one of its stream encodes.

Triton's gRPC stream carries an error's message but neither its code nor its
request id, and HTTP generate_stream answers 400 for every code (measured on
2.51), so both lead the message: "INVALID_ARG: [request id: r1] input 'height': ...".
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from engine_lib.interface import OutputSpec
from engine_lib.phases import PhaseClock
from engine_lib.request import (DiffusionOutput, EngineError, EngineUnavailableError, PipelineError, RequestTimedOutError,
                                RequestCancelledError)
from engine_lib.serving.tensors import output_arrays

ERROR_CODES = ("INVALID_ARG", "CANCELLED", "UNAVAILABLE", "INTERNAL")
MAX_ECHOED_ID = 128  # a 100 KB request id is not echoed back (or logged) in full
DRAIN_ENCODES_S = 10.0  # at shutdown, how long queued finals may still take to encode


@dataclass
class OpenStream:
    """One request's response stream (owned by the sender thread once opened)."""

    request_id: str  # the engine's id (unique)
    client_id: str  # what the client called it ("" if nothing), for messages and log lines
    response_sender: Any
    output_format: str
    start: float  # time.monotonic() at execute()
    first_response_at: Optional[float] = None
    pending: deque = field(default_factory=deque)  # (output, encoding Future or None), sent in this order
    final_queued: bool = False  # its final output is pending: later outputs are dropped


def error_message(error: BaseException, client_id: str = "") -> tuple[str, str]:
    """(code, message) for an error; unknown exceptions are INTERNAL."""
    code = getattr(error, "code", "INTERNAL")
    if code not in ERROR_CODES:
        code = "INTERNAL"
    request = f"[request id: {echoed_id(client_id)}] " if client_id else ""
    return code, f"{code}: {request}{error}"


def echoed_id(client_id: str) -> str:
    """A client's request id as messages and log lines repeat it: cut past MAX_ECHOED_ID characters."""
    return client_id if len(client_id) <= MAX_ECHOED_ID else client_id[:MAX_ECHOED_ID] + "..."


def refusal_outcome(error: BaseException) -> str:
    """The metrics outcome of a request refused before it ran: `unavailable` (queue full, shutting
    down) or `invalid` (its inputs)."""
    return "unavailable" if getattr(error, "code", "") == "UNAVAILABLE" else "invalid"


class ResponseSender:
    """Drains engine outputs into Triton responses on its own thread.

    `pb_utils` is Triton's `triton_python_backend_utils` module (passed in so this
    module imports without Triton); `abort` is the engine's abort(ids);
    `metrics` records outcomes and latencies (see metrics.py); `log` takes one line;
    `outputs` are the adapter's declared outputs (name -> OutputSpec).
    """

    _STOP = object()

    def __init__(self, pb_utils: Any, abort: Callable[[list[str]], None], metrics: Any,
                 log: Callable[[str], None], model_name: str, poll_interval_s: float = 0.05,
                 outputs: Optional[Mapping[str, OutputSpec]] = None, clock: Optional[PhaseClock] = None,
                 encode_workers: int = 2):
        self._pb = pb_utils
        self._clock = clock or PhaseClock()  # "encode" (tensors, PNG) and "send" seconds
        self._outputs = dict(outputs or {})  # the adapter's declared outputs, for output_format encodings
        self._abort = abort
        self._metrics = metrics
        self._log = log
        self._model_name = model_name
        self._poll_interval_s = poll_interval_s
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._streams: dict[str, OpenStream] = {}  # owned by the sender thread only
        self._thread = threading.Thread(target=self._run, name=f"{model_name}-sender", daemon=True)
        self._encoder = ThreadPoolExecutor(encode_workers, thread_name_prefix=f"{model_name}-encode")

    # -- producers (any thread; never block) --------------------------------------
    def start(self) -> None:
        self._thread.start()

    def open(self, stream: OpenStream) -> None:
        """Register a stream; call before the request enters the engine."""
        self._queue.put(("open", stream))

    def enqueue(self, output: DiffusionOutput) -> None:
        """The engine's sink: called from the busy loop, so it only enqueues."""
        self._queue.put(("output", output))

    def fail(self, request_id: str, error: BaseException) -> None:
        """End an opened stream whose request never entered the engine (e.g. queue full)."""
        self._queue.put(("fail", request_id, error))

    def reject(self, response_sender: Any, error: BaseException, client_id: str) -> None:
        """Answer a request that was never opened (bad input) with one FINAL error."""
        self._queue.put(("reject", response_sender, error, client_id))

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, end still-open streams with UNAVAILABLE, join the thread."""
        self._queue.put((self._STOP,))
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._log(f"{self._model_name}: sender thread still busy after {timeout_s:.1f} s")
        self._encoder.shutdown(wait=False, cancel_futures=True)

    # -- the sender thread ---------------------------------------------------------
    def _run(self) -> None:
        next_poll = time.monotonic() + self._poll_interval_s
        while True:
            timeout = max(0.0, next_poll - time.monotonic())
            try:
                message = self._queue.get(timeout=timeout)
            except queue.Empty:
                message = None
            if message is not None:
                if message[0] is self._STOP:
                    self._drain_and_end_all()
                    return
                self._handle(message)
            if time.monotonic() >= next_poll:
                self._poll_cancellations()
                next_poll = time.monotonic() + self._poll_interval_s

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        try:
            if kind == "open":
                stream = message[1]
                self._streams[stream.request_id] = stream
            elif kind == "output":
                self._on_output(message[1])
            elif kind == "encoded":
                stream = self._streams.get(message[1])
                if stream is not None:
                    self._flush(stream)
            elif kind == "fail":
                stream = self._streams.pop(message[1], None)
                if stream is not None:
                    self._send_error(stream.response_sender, message[2], stream.client_id)
                    self._metrics.request_done(refusal_outcome(message[2]), None)
            elif kind == "reject":
                self._send_error(message[1], message[2], message[3])
                self._metrics.request_done(refusal_outcome(message[2]), None)
        except Exception as exc:  # noqa: BLE001 - one bad message must not stop the thread
            self._log(f"{self._model_name}: sender error on {kind}: {exc!r}")

    def _on_output(self, output: DiffusionOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None or stream.final_queued:
            return  # already ended (cancelled by the client), or a second final: drop it
        stream.final_queued = output.is_final
        job = None
        if output.error is None and self._encodes(stream.output_format, output):
            job = self._encoder.submit(self._arrays, output, stream.output_format)
            job.add_done_callback(lambda _job, request_id=output.request_id: self._queue.put(("encoded", request_id)))
        stream.pending.append((output, job))
        self._flush(stream)

    def _encodes(self, output_format: str, output: DiffusionOutput) -> bool:
        """Whether this response carries an output to encode (png, mp4): the slow part, done on the pool."""
        return output_format != "raw" and any(output_format in self._outputs[name].encodings
                                              for name in output.outputs if name in self._outputs)

    def _arrays(self, output: DiffusionOutput, output_format: str) -> dict:
        with self._clock.phase("encode"):
            return output_arrays(output, output_format, self._outputs)

    def _flush(self, stream: OpenStream) -> None:
        """Send the stream's pending responses in order, up to the first still encoding."""
        while stream.pending and self._streams.get(stream.request_id) is stream:
            output, job = stream.pending[0]
            if job is not None and not job.done():
                return
            stream.pending.popleft()
            self._send(stream, output, job)

    def _send(self, stream: OpenStream, output: DiffusionOutput, job: Optional[Future]) -> None:
        now = time.monotonic()
        if output.is_final:
            del self._streams[output.request_id]
        try:
            if output.error is not None:
                self._send_error(stream.response_sender, output.error, stream.client_id)
            else:
                arrays = job.result() if job is not None else self._arrays(output, stream.output_format)
                response = self._pb.InferenceResponse(
                    output_tensors=[self._pb.Tensor(name, array) for name, array in arrays.items()])
                flags = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if output.is_final else 0
                with self._clock.phase("send"):
                    stream.response_sender.send(response, flags=flags)
        except Exception as exc:  # noqa: BLE001 - end the stream with what can still be sent
            self._log(f"{self._model_name}: send failed for request {stream.request_id}: {exc!r}")
            if not output.is_final:
                self._streams.pop(output.request_id, None)
                self._abort([output.request_id])
            # The send may have failed on this response (e.g. its encoding) with the stream still
            # open: try once to end it with an error, so the client is not left waiting.
            try:
                self._send_error(stream.response_sender, PipelineError(f"could not send a response: {exc}"),
                                 stream.client_id)
            except Exception:  # noqa: BLE001 - the stream itself is gone
                pass
            self._metrics.request_done("error", None)
            return
        if stream.first_response_at is None:
            stream.first_response_at = now
            self._metrics.first_response(now - stream.start)
        if output.is_final:
            outcome = "success" if output.error is None else _outcome_of(output.error)
            self._metrics.request_done(outcome, now - stream.start)
        else:
            self._check_cancelled(stream)

    def _poll_cancellations(self) -> None:
        for stream in list(self._streams.values()):
            self._check_cancelled(stream)

    def _check_cancelled(self, stream: OpenStream) -> None:
        try:
            cancelled = stream.response_sender.is_cancelled()
        except Exception:  # noqa: BLE001 - treat an unreachable stream as cancelled
            cancelled = True
        if not cancelled:
            return
        self._streams.pop(stream.request_id, None)
        self._abort([stream.request_id])
        self._log(f"{self._model_name}: cancelled request {stream.request_id}")
        try:
            self._send_error(stream.response_sender, RequestCancelledError("cancelled by the client"),
                             stream.client_id)
        except Exception as exc:  # noqa: BLE001
            self._log(f"{self._model_name}: could not end cancelled request {stream.request_id}: {exc!r}")
        self._metrics.request_done("cancelled", None)

    def _drain_and_end_all(self) -> None:
        while True:
            try:
                message = self._queue.get_nowait()
            except queue.Empty:
                break
            if message[0] is not self._STOP:
                self._handle(message)
        jobs = [job for stream in self._streams.values() for _, job in stream.pending if job is not None]
        wait(jobs, timeout=DRAIN_ENCODES_S)  # what the engine finished still goes out, if it encodes in time
        for stream in list(self._streams.values()):
            self._flush(stream)
        for stream in list(self._streams.values()):
            stream.pending.clear()
            stream.final_queued = False
            self._on_output(DiffusionOutput(stream.request_id, 0, 0, True,
                                            error=EngineUnavailableError("model is shutting down")))

    def _send_error(self, response_sender: Any, error: BaseException, client_id: str) -> None:
        code, message = error_message(error, client_id)
        triton_code = getattr(self._pb.TritonError, code, self._pb.TritonError.INTERNAL)
        response = self._pb.InferenceResponse(error=self._pb.TritonError(message, triton_code))
        response_sender.send(response, flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    @property
    def num_open_streams(self) -> int:
        return len(self._streams)


def _outcome_of(error: EngineError) -> str:
    if isinstance(error, RequestTimedOutError):
        return "timed_out"
    return "cancelled" if getattr(error, "code", "") == "CANCELLED" else "error"
