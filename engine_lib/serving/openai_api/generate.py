"""Triton's `generate` and `generate_stream`, strict: the front door's HTTP path to any model.

Same URLs, body and answers as tritonserver's own endpoints (a JSON object of the
model's inputs in; the outputs as JSON, one `data:` event per response when
streaming), with what tritonserver 2.51's own parser lets through refused here, 400
naming the input (`{"error": "INVALID_ARG: input 'height': ..."}`):

- a key that is neither an input of the model nor `id` (tritonserver passes it on as
  a request parameter);
- an integer past its input's range (tritonserver wraps 4294967424 to 128 for INT32),
  a float or string or bool for an integer input (tritonserver: HTTP 500 "Unable to
  parse 'data'", no input named), a list (tritonserver flattens `[[64]]` to 64);
- bodies over 1 MiB (413) or nested too deep (tritonserver 2.51 crashes on 50,000 `[`);
- text with a lone surrogate (`"\\ud800"`), which is no Unicode text;
- a `priority` past the caller's rights (403 PERMISSION_DENIED, keys.py).

Each request runs on its own gRPC stream, so a client that leaves cancels it at once
(tritonserver's HTTP port notices only at the next response it sends).

Raw outputs are JSON lists of numbers, about 5 bytes a uint8 value: a 229-frame 512x512
video is about 0.9 GB of JSON. One response may take at most MAX_RESPONSE_JSON_BYTES: a
request whose declared size (height x width x num_frames x num_images x 3) is over it is
refused before it runs (400 naming `output_format`), and any response over it (sizes the
model chose) ends the request with that error. A response's JSON is written in pieces,
each built on a worker thread, so it never sits whole in memory and the event loop keeps
answering other clients while it goes out.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, AsyncIterator, Iterator, Mapping

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import iterate_in_threadpool

from engine_lib.request import InvalidInputError
from engine_lib.serving.openai_api.gateway import Response, TritonGateway, TritonRequestError
from engine_lib.serving.openai_api.keys import Caller, FrontDoorKeys
from engine_lib.serving.openai_api.requests import OpenAIError
from engine_lib.serving.openai_api.watch import next_response, until_final

MAX_ID_CHARS = 256
# Triton error codes -> the HTTP status tritonserver's generate endpoints answer them with.
HTTP_STATUS = {"INVALID_ARG": 400, "NOT_FOUND": 404, "UNAVAILABLE": 503, "CANCELLED": 499}
# The most JSON one response (one event of generate_stream) may take. 64 MiB holds a 2048x2048
# image or 17 frames of 512x512 as raw uint8 lists; a client parses each event whole (json.loads of
# 58 MiB of them: 2 s, into a 100 MiB list), so more is of no use over HTTP JSON, where the
# encoded outputs (output_format=png, mp4) are 10-100x smaller. gRPC carries raw tensors as binary.
MAX_RESPONSE_JSON_BYTES = 64 << 20
UINT8_CHARS = len("255, ")  # the most JSON a raw uint8 value takes
PIECE_VALUES = 1 << 18  # values per piece of a response's JSON: ~1.2 MiB of text, ~10 ms of the GIL
UINT8_TEXT = np.array([str(value) for value in range(256)], dtype=object)  # 5x faster than json.dumps


class GenerateError(Exception):
    """An error answered as tritonserver answers one: `{"error": message}` with an HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.message}, status_code=self.status)


def from_triton(message: str) -> GenerateError:
    return GenerateError(HTTP_STATUS.get(message.split(":", 1)[0].strip(), 500), message)


def parse_generate_body(body: Any, model: str, input_types: dict[str, str]) -> tuple[dict[str, Any], str]:
    """(inputs, request id) of a generate body; raises GenerateError naming the first bad key."""
    if not isinstance(body, dict):
        raise GenerateError(400, "INVALID_ARG: the request body must be a JSON object of the model's inputs")
    unknown = sorted(k for k in body if k not in input_types and k != "id")
    if unknown:
        raise GenerateError(400, f"INVALID_ARG: input '{unknown[0]}': {model} has no such input "
                                 f"(its inputs: {', '.join(input_types)})")
    request_id = body.get("id", "")
    if not isinstance(request_id, str) or len(request_id) > MAX_ID_CHARS:
        raise GenerateError(400, f"INVALID_ARG: id must be a string of at most {MAX_ID_CHARS} characters")
    inputs = {name: value[0] if isinstance(value, list) and len(value) == 1 and not isinstance(value[0], (list, dict))
              else value for name, value in body.items() if name != "id"}  # [64] is a [1] tensor, as in Triton
    return inputs, request_id


def output_text(response: Response, model: str, before: str = "", after: str = "") -> Iterator[str]:
    """A response's JSON as tritonserver's generate endpoints write it (one element as a scalar, more as a
    flat list), between `before` and `after`, in pieces of at most PIECE_VALUES values: no piece holds the
    GIL long or much memory, so `iterate_in_threadpool` sends a big output without stalling the event loop."""
    text = before + json.dumps({"model_name": model, "model_version": response.model_version})[:-1]
    for name, array in response.outputs.items():
        flat = np.asarray(array).ravel()
        text += f", {json.dumps(name)}: "
        if flat.size == 1:
            text += json_values(flat)
            continue
        text += "["
        for start in range(0, flat.size, PIECE_VALUES):
            yield text + (", " if start else "") + json_values(flat[start:start + PIECE_VALUES])
            text = ""
        text += "]"
    yield text + "}" + after


def json_values(values: np.ndarray) -> str:
    """Values as JSON without the list's brackets (text decoded as UTF-8)."""
    if values.dtype == np.uint8:
        return ", ".join(UINT8_TEXT[values].tolist())
    return json.dumps([v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v
                       for v in values.tolist()])[1:-1]


def too_big(json_bytes: int, what: str) -> GenerateError:
    return GenerateError(400, f"INVALID_ARG: input 'output_format': {what} would take up to {-(-json_bytes >> 20)} MiB "
                              f"of JSON per response, over this front door's {MAX_RESPONSE_JSON_BYTES >> 20} MiB: "
                              f"ask for output_format=png (images) or mp4 (videos), or use gRPC for raw tensors")


def check_declared_size(inputs: Mapping[str, Any]) -> None:
    """Refuse, before it runs, a request for raw outputs whose declared size is over MAX_RESPONSE_JSON_BYTES.
    Only sizes the request states count (left-out frames and images as 1); the model's defaults are left to
    `check_response`."""
    if inputs.get("output_format", "raw") != "raw" or "height" not in inputs or "width" not in inputs:
        return
    frames, images = inputs.get("num_frames", 1), inputs.get("num_images", 1)
    json_bytes = inputs["height"] * inputs["width"] * frames * images * 3 * UINT8_CHARS
    if json_bytes > MAX_RESPONSE_JSON_BYTES:
        raise too_big(json_bytes, f"raw output of {inputs['width']}x{inputs['height']}, {frames} frame(s), "
                                  f"{images} image(s)")


def check_response(response: Response) -> None:
    """Refuse a response whose raw outputs could take over MAX_RESPONSE_JSON_BYTES of JSON (counted from their
    sizes, before any of it is built): the backstop for sizes the request did not state."""
    json_bytes = sum(array.size * value_chars(array.dtype) for array in map(np.asarray, response.outputs.values())
                     if array.dtype.kind != "O")  # text outputs are the encoded ones
    if json_bytes > MAX_RESPONSE_JSON_BYTES:
        raise too_big(json_bytes, "this response's raw output")


def value_chars(dtype: np.dtype) -> int:
    """The most JSON one value of a raw output takes, with its separator (uint8: '255, ')."""
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return max(len(str(info.min)), len(str(info.max))) + 2
    return len("false, ") if dtype.kind == "b" else 26  # a float's longest repr is 24 characters


def event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def make_router(read_json, authorize, keys: FrontDoorKeys) -> APIRouter:
    """The two endpoints; `read_json(request)` is the app's bounded body reader, `authorize` its bearer key
    dependency (the caller), `keys` the callers' priority rights."""
    router = APIRouter()
    request_ids = itertools.count(1)

    async def start(model: str, request: Request, caller: Caller) -> AsyncIterator[Response]:
        gateway: TritonGateway = request.app.state.gateway
        try:
            body = await read_json(request)
        except OpenAIError as exc:
            raise GenerateError(exc.status, f"INVALID_ARG: {exc.message}") from None
        try:
            input_types = await gateway.input_types(model)
        except Exception as exc:  # noqa: BLE001 - tritonclient's error for an unknown or unready model
            raise GenerateError(404, f"NOT_FOUND: model '{model}' is not served here ({exc})") from None
        inputs, client_id = parse_generate_body(body, model, input_types)
        try:
            tensors = gateway.tensors(inputs, input_types)
        except InvalidInputError as exc:
            raise GenerateError(400, f"INVALID_ARG: {exc}") from None
        check_declared_size(inputs)
        try:
            parameters = keys.priority_parameters(caller, inputs.get("priority"), await gateway.default_priority(model))
        except OpenAIError as exc:
            raise GenerateError(exc.status, f"PERMISSION_DENIED: input 'priority': {exc.message}") from None
        return gateway.stream(model, tensors, client_id or f"generate-{next(request_ids)}", parameters)

    @router.post("/v2/models/{model}/generate_stream")
    async def generate_stream(model: str, request: Request, caller: Caller = Depends(authorize)):
        try:
            responses = await start(model, request, caller)
            first = await next_response(responses, request, on_error=from_triton)  # an error first: HTTP error
        except GenerateError as exc:
            return exc.response()
        return StreamingResponse(events(model, first, responses), media_type="text/event-stream")

    @router.post("/v2/models/{model}/generate")
    async def generate(model: str, request: Request, caller: Caller = Depends(authorize)):
        try:
            responses = await start(model, request, caller)
            final = await until_final(responses, request, on_error=from_triton)
            check_response(final)
        except GenerateError as exc:
            return exc.response()
        return StreamingResponse(output_text(final, model), media_type="application/json")  # each piece on a thread

    return router


async def events(model: str, first: Response, responses: AsyncIterator[Response]):
    """One `data:` event per response, written in pieces on worker threads; an error after the first (or a
    response over MAX_RESPONSE_JSON_BYTES) becomes an `{"error": ...}` event. Starlette cancels this
    generator when the client leaves, and `aclose()` cancels the request."""
    try:
        response = first
        while True:
            check_response(response)
            async for piece in iterate_in_threadpool(output_text(response, model, "data: ", "\n\n")):
                yield piece
            if response.is_final:
                return
            response = await responses.__anext__()
    except GenerateError as exc:
        yield event({"error": exc.message})
    except TritonRequestError as exc:
        yield event({"error": str(exc)})
    except StopAsyncIteration:
        yield event({"error": "INTERNAL: the model ended the request without a final response"})
    finally:
        await responses.aclose()
