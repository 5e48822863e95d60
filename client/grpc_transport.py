"""gRPC streaming transport: one decoupled request on a tritonclient stream.

Responses arrive on tritonclient's stream thread; a queue hands them to the
caller's thread, which waits in short slices so Ctrl-C is delivered promptly.
Leaving the generator early (error, timeout, KeyboardInterrupt, close())
stops the stream with cancel_requests=True, which cancels the request on the
server.
"""

from __future__ import annotations

import queue
import time
from typing import Any, Dict, Iterator, Optional, Union

import numpy as np
from tritonclient.utils import InferenceServerException

from client.decode import decode_response
from client.events import (
    Final,
    Progress,
    RequestTimeoutError,
    ServerError,
    ServerUnreachableError,
)

_NP_DTYPES = {"BYTES": np.object_, "INT32": np.int32, "INT64": np.int64, "FP32": np.float32, "BOOL": np.bool_}
_OUTPUTS = ("image", "image_png", "video", "video_mp4", "frame_rate", "frame_offset", "audio", "audio_sample_rate",
            "step", "num_steps", "is_final", "text", "finish_reason")
# gRPC statuses that mean the transport failed, not the model.
_TRANSPORT_STATUSES = ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")


def _infer_inputs(inputs: Dict[str, Any], dtypes: Dict[str, str]) -> list:
    import tritonclient.grpc as grpcclient

    result = []
    for name, value in inputs.items():
        dtype = dtypes[name]
        values = value if isinstance(value, list) else [value]  # a list: one [n] input (several images)
        if dtype == "BYTES":
            values = [item.encode("utf-8") for item in values]
        arr = np.array(values, dtype=_NP_DTYPES[dtype])
        tensor = grpcclient.InferInput(name, list(arr.shape), dtype)
        tensor.set_data_from_numpy(arr)
        result.append(tensor)
    return result


def _outputs(result) -> Dict[str, Any]:
    response = result.get_response()
    names = {out.name for out in response.outputs}
    return {name: result.as_numpy(name) for name in _OUTPUTS if name in names}


def _is_final_flag(result) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


def _raise_for(error, url: str) -> None:
    status = error.status() if hasattr(error, "status") else None
    message = error.message() if hasattr(error, "message") else str(error)
    if status in _TRANSPORT_STATUSES:
        raise ServerUnreachableError(f"cannot reach Triton at {url} over gRPC: {message}")
    raise ServerError(message or str(error), status=status)


def grpc_events(
    url: str, model: str, inputs: Dict[str, Any], dtypes: Dict[str, str], timeout: Optional[float]
) -> Iterator[Union[Progress, Final]]:
    """Send one request on a new stream and yield its events until the final one."""
    import tritonclient.grpc as grpcclient

    responses: "queue.Queue[tuple]" = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    deadline = None if timeout is None else time.monotonic() + timeout
    completed = False
    try:
        try:
            client.start_stream(callback=lambda result, error: responses.put((result, error)))
            client.async_stream_infer(
                model, _infer_inputs(inputs, dtypes), enable_empty_final_response=True
            )
        except InferenceServerException as exc:
            # The stream can fail before the request is queued; the reason (for
            # example "connection refused") then comes through the callback.
            _raise_for(_callback_error(responses) or exc, url)
        final_seen = False
        while True:
            result, error = _next(responses, deadline)
            if error is not None:
                _raise_for(error, url)
            is_last = _is_final_flag(result)
            completed = is_last  # nothing left to cancel once Triton's final flag arrived
            event = decode_response(_outputs(result), is_last)
            if event is not None:
                final_seen = final_seen or isinstance(event, Final)
                yield event
            if is_last:
                if not final_seen:
                    raise ServerError("the server ended the request without a final image")
                return
    finally:
        # A finished request leaves nothing to cancel; anything else is cancelled.
        stop_stream(client, cancel=not completed)
        client.close()


def stop_stream(client, cancel: bool) -> None:
    """`client.stop_stream(cancel_requests=cancel)` without the thread tritonclient 2.50 leaks on a cancel.

    Its stream's request iterator (a thread inside grpc) waits for an end marker that
    `stop_stream(cancel_requests=True)` never puts, so every cancelled stream left one thread
    blocked for the life of the process (measured: one more per cancel). Putting the marker
    after the cancel lets that thread end.
    """
    stream = getattr(client, "_stream", None)
    client.stop_stream(cancel_requests=cancel)
    request_queue = getattr(stream, "_request_queue", None)
    if cancel and request_queue is not None:
        request_queue.put(None)


def _callback_error(responses: "queue.Queue[tuple]", wait_s: float = 1.0):
    """The error the stream thread reported, if it reports one within `wait_s`."""
    try:
        return responses.get(timeout=wait_s)[1]
    except queue.Empty:
        return None


def _next(responses: "queue.Queue[tuple]", deadline: Optional[float]) -> tuple:
    while True:
        try:
            return responses.get(timeout=0.2)
        except queue.Empty:
            if deadline is not None and time.monotonic() > deadline:
                raise RequestTimeoutError("no final response before the client timeout") from None
