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
"""

from __future__ import annotations

import itertools
import json
from typing import Any, AsyncIterator

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine_lib.request import InvalidInputError
from engine_lib.serving.openai_api.gateway import Response, TritonGateway, TritonRequestError
from engine_lib.serving.openai_api.keys import Caller, FrontDoorKeys
from engine_lib.serving.openai_api.requests import OpenAIError
from engine_lib.serving.openai_api.watch import next_response, until_final

MAX_ID_CHARS = 256
# Triton error codes -> the HTTP status tritonserver's generate endpoints answer them with.
HTTP_STATUS = {"INVALID_ARG": 400, "NOT_FOUND": 404, "UNAVAILABLE": 503, "CANCELLED": 499}


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


def output_json(response: Response, model: str) -> dict[str, Any]:
    """A response as tritonserver's generate endpoints write it: one element as a scalar, more as a flat list."""
    body: dict[str, Any] = {"model_name": model, "model_version": response.model_version}
    for name, array in response.outputs.items():
        values = [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v
                  for v in np.asarray(array).ravel().tolist()]
        body[name] = values[0] if len(values) == 1 else values
    return body


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
        except GenerateError as exc:
            return exc.response()
        return output_json(final, model)

    return router


async def events(model: str, first: Response, responses: AsyncIterator[Response]):
    """One `data:` event per response; an error after the first becomes an `{"error": ...}` event.
    Starlette cancels this generator when the client leaves, and `aclose()` cancels the request."""
    try:
        response = first
        while True:
            yield event(output_json(response, model))
            if response.is_final:
                return
            response = await responses.__anext__()
    except TritonRequestError as exc:
        yield event({"error": str(exc)})
    except StopAsyncIteration:
        yield event({"error": "INTERNAL: the model ended the request without a final response"})
    finally:
        await responses.aclose()
