"""Test-side helpers: one gRPC stream per request, HTTP SSE reading, /metrics scraping.

One stream per request because Triton's gRPC stream hands errors to the
callback without their request id.
"""

from __future__ import annotations

import json
import queue
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client.grpc_transport import stop_stream
from engine_lib.pipelines import registry
from engine_lib.serving.tensors import NUMPY_DTYPES

MODEL = "qwen_image"
# Every registered pipeline's declared inputs: name -> (Triton datatype, numpy dtype).
INPUT_TYPES = {spec.name: (spec.datatype, NUMPY_DTYPES[spec.datatype][0])
               for name in registry.names() for spec in registry.get_adapter_class(name).inputs}


def make_inputs(**values: Any) -> list[grpcclient.InferInput]:
    """Scalars become [1] tensors of the model's datatype, lists [len] ones; a (datatype, array) pair is sent
    as given."""
    inputs = []
    for name, value in values.items():
        if isinstance(value, tuple):
            datatype, array = value
        else:
            datatype, dtype = INPUT_TYPES[name]
            if isinstance(value, str):
                value = value.encode("utf-8")
            array = np.array(value if isinstance(value, list) else [value], dtype=dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


@dataclass
class StreamResult:
    """Everything one request's stream delivered."""

    responses: list = field(default_factory=list)  # tritonclient InferResult, in arrival order
    errors: list = field(default_factory=list)  # InferenceServerException

    @property
    def num_final(self) -> int:
        flagged = sum(1 for r in self.responses if is_final_response(r))
        return flagged + len(self.errors)  # our errors are always FINAL

    @property
    def final(self):
        assert self.responses and is_final_response(self.responses[-1]), "no final response"
        return self.responses[-1]

    @property
    def error(self) -> InferenceServerException:
        assert self.errors, f"expected an error, got {len(self.responses)} responses"
        return self.errors[-1]

    def steps(self) -> list[int]:
        return [int(r.as_numpy("step")[0]) for r in self.responses]


def is_final_response(result) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


class RequestStream:
    """One request on its own gRPC stream."""

    def __init__(self, url: str):
        self.client = grpcclient.InferenceServerClient(url)
        self._queue: "queue.Queue[tuple]" = queue.Queue()
        self.result = StreamResult()
        self.request_id = ""
        self.final_at: Optional[float] = None  # monotonic time the final response (or error) arrived
        self.client.start_stream(callback=self._on_response)  # last: a callback may come at once

    def _on_response(self, result, error) -> None:
        if self.final_at is None and (error is not None or is_final_response(result)):
            self.final_at = time.monotonic()
        self._queue.put((result, error))

    def send(self, request_id: str = "", model: str = MODEL, timeout_us: Optional[int] = None,
             parameters: Optional[dict] = None, **inputs: Any) -> "RequestStream":
        """`timeout_us`: Triton's request timeout (tritonclient's `timeout=`); `parameters`: request parameters
        (e.g. servers.URGENT, the priority key)."""
        self.request_id = request_id
        self.client.async_stream_infer(model, make_inputs(**inputs), request_id=request_id,
                                       enable_empty_final_response=True, timeout=timeout_us, parameters=parameters)
        return self

    def _take(self, timeout: float) -> bool:
        """Store the next item; True if it ended the request."""
        result, error = self._queue.get(timeout=timeout)
        if error is not None:
            self.result.errors.append(error)
            return True
        self.result.responses.append(result)
        return is_final_response(result)

    def has_response(self) -> bool:
        """Whether anything (a response or an error) has arrived, read or not."""
        return bool(self.result.responses or self.result.errors) or not self._queue.empty()

    def wait_first(self, timeout: float = 60.0) -> StreamResult:
        """Wait for the first response (or error)."""
        self._take(timeout)
        return self.result

    def collect(self, timeout: float = 120.0, settle_s: float = 0.3) -> StreamResult:
        """Read until the final response, then a little longer to catch anything sent after it."""
        deadline = time.monotonic() + timeout
        ended = self.result.num_final > 0
        while not ended:
            ended = self._take(max(0.01, deadline - time.monotonic()))
        end = time.monotonic() + settle_s
        while time.monotonic() < end:
            try:
                self._take(max(0.01, end - time.monotonic()))
            except queue.Empty:
                break
        return self.result

    def cancel(self) -> None:
        stop_stream(self.client, cancel=True)

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def run_concurrently(url: str, cases: list[dict], prefix: str = "c", model: str = MODEL,
                     timeout: float = 180.0) -> list[StreamResult]:
    """Send every case at once, each on its own stream (request ids prefix0, prefix1, ...), and collect all."""
    streams = [RequestStream(url).send(f"{prefix}{i}", model=model, **case) for i, case in enumerate(cases)]
    try:
        return [stream.collect(timeout=timeout) for stream in streams]
    finally:
        close_all(streams)


def close_all(streams, budget=None) -> None:
    """Release a held engine first (a stream with a request in flight closes only once it has ended),
    then close every stream."""
    if budget is not None:
        budget.release()
    for stream in streams:
        stream.close()


def run_held(server, waiting: int, ticks: int, model: str = MODEL) -> None:
    """Once `waiting` requests wait in the held engine (its gauge says so), let exactly `ticks` ticks run."""
    assert wait_for_metric(server.metrics_url, "diffusion_requests_waiting", float(waiting), model=model) == waiting
    server.budget.allow(ticks)


def run_request(url: str, timeout: float = 120.0, request_id: str = "", **inputs: Any) -> StreamResult:
    stream = RequestStream(url)
    try:
        return stream.send(request_id, **inputs).collect(timeout)
    finally:
        stream.close()


# -- HTTP ---------------------------------------------------------------------------


def post_json(url: str, body: dict, timeout: float = 120.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def sse_events(body: bytes) -> list[dict]:
    """The JSON objects of a server-sent-events body (`data: {...}` lines)."""
    events = []
    for line in body.decode("utf-8").splitlines():
        if line.startswith("data:"):
            events.append(json.loads(line[len("data:"):]))
    return events


# -- metrics -------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(metrics_url: str) -> dict[tuple, float]:
    """{(name, frozenset(labels)): value} of a Prometheus text page."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, labels, value = match.groups()
        pairs = frozenset(re.findall(r'(\w+)="([^"]*)"', labels or ""))
        samples[(name, pairs)] = float(value)
    return samples


def metric(samples: dict, name: str, **labels: str) -> float:
    """The sum over every series of `name` that carries `labels` (as PromQL's sum() does), e.g. over
    a model's instances."""
    wanted = frozenset(labels.items())
    return sum(value for (sample_name, pairs), value in samples.items() if sample_name == name and wanted <= pairs)


def wait_for_metric(metrics_url: str, name: str, expected: float, timeout: float = 10.0,
                    **labels: str) -> Optional[float]:
    """Poll until the metric equals `expected`; returns the last value seen."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = metric(scrape(metrics_url), name, **labels)
        if value == expected:
            return value
        time.sleep(0.2)
    return value
