"""The FastAPI app of the front door: the OpenAI Images API (`/v1/models`, `/v1/images/generations`,
`/v1/images/edits` for the models with an `image` input) and strict versions of Triton's `generate` /
`generate_stream` (generate.py).

An edit is a multipart/form-data body: its image file goes to the model's `image` input as it
came, its mask file (if any) to `mask_image`, its other fields as a generations body would
(requests.py). Its body may hold files of MAX_IMAGE_BYTES each, MAX_EDIT_FILES_BYTES together,
and a request's fields; every other body stays within MAX_BODY_BYTES.

Streaming (`stream: true`) answers server-sent events as OpenAI streams images: up to
`partial_images` events `image_generation.partial_image` (the engine's previews, spread
over the steps), then one `image_generation.completed` per image. An error before the
first event is an HTTP error in OpenAI's shape; after it, an `error` event. A client that
goes away cancels its Triton request: within half a second while the front door waits for a
response (watch.py; a stream without partial images waits for its only one), at once while
it streams. PNG encoding runs on worker threads (about 0.3 s per 1024x1024 image), never on
the event loop that answers every other client.

A model that thinks before it draws (BAGEL with `think: true`, an extra field as any declared input) sends its
thought as the `text` output: it comes back as each image's `revised_prompt`.

Chat completions (`/v1/chat/completions`, for the models that answer in text): chat.py. Video jobs (`/v1/videos`,
for the models with a `video_mp4` output): videos.py. Bearer keys and priority
rights: keys.py. `/openapi.json` needs a key like the API (it lists every input of the API); there are no
`/docs` pages.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional

import numpy as np
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect

from engine_lib.images import MAX_IMAGE_BYTES
from engine_lib.request import InvalidInputError
from engine_lib.serving.openai_api.gateway import InputType, Response, TritonGateway, TritonRequestError
from engine_lib.serving.openai_api.keys import Caller, FrontDoorKeys
from engine_lib.serving.openai_api.requests import (ImageRequest, OpenAIError, bad_request, error_from_triton,
                                                    lone_surrogate_field, openai_param, parse_edit_request,
                                                    parse_image_request)
from engine_lib.serving.openai_api.generate import make_router
from engine_lib.serving.openai_api import chat, files, videos
from engine_lib.serving.openai_api.store import Store, open_store
from engine_lib.serving.openai_api.watch import next_response, until_final
from engine_lib.serving.tensors import encode_png_base64

MAX_BODY_BYTES = 1 << 20  # a request is a prompt and a few numbers; anything this big is not one
BODY_TIMEOUT_S = 30.0  # 1 MiB at 35 kB/s; a client that dribbles its body slower holds a request for nothing
# A body over MAX_BODY_BYTES is still read (and dropped) up to this size before the 413, so that a client still
# sending it reads the answer instead of a reset connection; one announced larger is refused unread.
MAX_DISCARD_BYTES = 8 << 20
DRAIN_TIMEOUT_S = 5.0  # how long a body announced over the limit is waited for before its 413
# An edit's form: its files (an image and a mask, each within MAX_IMAGE_BYTES) within MAX_EDIT_FILES_BYTES together,
# so that its Triton request still fits the gRPC gate's 16 MiB message, and a request's worth of fields; 120 s is
# 131 kB/s for all of it.
MAX_EDIT_FILES_BYTES = 14 << 20
MAX_EDIT_BODY_BYTES = MAX_EDIT_FILES_BYTES + MAX_BODY_BYTES
EDIT_BODY_TIMEOUT_S = 120.0
MAX_FORM_FILES, MAX_FORM_FIELDS = 16, 64  # OpenAI takes up to 16 images; a form of more is no request
# The usage OpenAI reports for GPT image models; these models count no tokens.
NO_USAGE = {"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}, "output_tokens": 0,
            "total_tokens": 0}


def png_base64(images: np.ndarray) -> list[str]:
    """Images [N, H, W, 3] as base64 PNG text, encoded as the model's own `png` output is. Run it on a worker
    thread (`run_in_threadpool`): PIL lets go of the GIL while it compresses, so the event loop keeps serving."""
    return [text.decode("ascii") for text in encode_png_base64(images, {})]


def partial_steps(num_steps: int, partial_images: int) -> list[int]:
    """The steps whose previews become partial images: spread evenly, before the last step."""
    steps = {max(1, round(num_steps * (i + 1) / (partial_images + 1))) for i in range(partial_images)}
    return sorted(s for s in steps if s < num_steps)


def create_app(triton_url: str, keys: FrontDoorKeys = FrontDoorKeys(), store: Optional[Store] = None) -> FastAPI:
    """The app, talking gRPC to the tritonserver at `triton_url`; with `keys`, requests need one of them. Jobs and
    stored images go to `store` (default: the one the environment names, store.open_store)."""
    request_ids = itertools.count(1)
    store = store or open_store(os.environ)  # at once: a bad setting or an unreachable database stops the start

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.gateway = TritonGateway(triton_url)  # the asyncio client belongs to the server's loop
        app.state.store = store
        app.state.videos = videos.VideoJobs(app.state.store)
        heartbeat = asyncio.create_task(app.state.videos.heartbeat())
        yield
        heartbeat.cancel()
        await app.state.videos.close()  # cancels the running jobs' Triton requests
        await app.state.gateway.close()

    app = FastAPI(title="diffusion-triton OpenAI Images API", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # served below, behind the key

    @app.exception_handler(OpenAIError)
    async def openai_error(_request: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    async def authorize(credentials: Optional[HTTPAuthorizationCredentials] = Depends(HTTPBearer(auto_error=False))
                        ) -> Caller:
        # A dependency, not an HTTP middleware: Starlette's middleware wraps the request's receive
        # channel, and the endpoints would no longer see a client disconnect. HTTPBearer reads the
        # scheme case-insensitively (RFC 7235: `bearer` is `Bearer`).
        caller = keys.caller(credentials.credentials if credentials else None)
        if caller is None:
            raise OpenAIError(401, "missing or wrong API key (Authorization: Bearer <key>)", code="invalid_api_key")
        return caller

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(authorize)])
    async def openapi() -> dict:
        return app.openapi()

    @app.get("/health")
    async def health(request: Request) -> dict:
        """Ready: the front door serves and so does Triton through it (the gate, every model loaded); else 503,
        as /v1/models answers then. The probes' readiness (`serve ready`) asks this."""
        if not await request.app.state.gateway.server_ready():
            raise OpenAIError(503, f"Triton at {request.app.state.gateway.url} is not ready", code="unavailable",
                              type_="server_error")
        return {"status": "ok"}

    @v1.get("/models")
    async def models(request: Request) -> dict:
        names = await ready_models(request.app.state.gateway)
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "triton"}
                                           for n in names]}

    async def model_inputs(gateway: TritonGateway, model: Any) -> tuple[dict[str, InputType], Optional[str]]:
        """(the declared inputs of the model asked for, or of the only ready one; the default model): 404 for a
        model not served here."""
        names = await ready_models(gateway)
        if model is not None and model not in names:
            raise OpenAIError(404, f"model {model!r} is not served here (ready: {', '.join(names)})", param="model",
                              code="model_not_found")
        default = names[0] if len(names) == 1 else None
        return (await gateway.input_types(model or default) if (model or default) else {}), default

    @v1.post("/images/generations")
    async def generations(request: Request, caller: Caller = Depends(authorize)):
        body = await read_json(request)
        input_types, default = await model_inputs(request.app.state.gateway,
                                                  body.get("model") if isinstance(body, dict) else None)
        return await run(request, caller, parse_image_request(body, input_types, default), input_types,
                         "image_generation")

    @v1.post("/images/edits")
    async def edits(request: Request, caller: Caller = Depends(authorize)):
        fields, files = await read_form(request)
        model = next((value for name, value in fields if name == "model"), None)
        input_types, default = await model_inputs(request.app.state.gateway, model)
        return await run(request, caller, parse_edit_request(fields, files, input_types, default), input_types,
                         "image_edit")

    async def run(request: Request, caller: Caller, image_request: ImageRequest, input_types: dict[str, InputType],
                  kind: str):
        """Send the request to its model and answer with its images (events named `<kind>.partial_image` and
        `<kind>.completed` when streamed)."""
        gateway: TritonGateway = request.app.state.gateway
        request_id = f"openai-{next(request_ids)}"
        try:
            tensors = gateway.tensors(image_request.inputs, input_types)
        except InvalidInputError as exc:
            raise bad_request(str(exc), openai_param(exc.input_name)) from None
        parameters = keys.priority_parameters(caller, image_request.inputs.get("priority"),
                                              await gateway.default_priority(image_request.model))
        responses = gateway.stream(image_request.model, tensors, request_id, parameters)
        if image_request.stream:  # watched: without partial images the first response is the last
            first = await next_response(responses, request, on_error=error_from_triton)
            return StreamingResponse(events(image_request, first, responses, kind), media_type="text/event-stream")
        final = await until_final(responses, request, on_error=error_from_triton)
        images = await run_in_threadpool(png_base64, final.images)
        thought = final.outputs.get("text")  # a model that thought before drawing (BAGEL's think) sends it
        extra = {"revised_prompt": thought.ravel()[0].decode("utf-8", errors="replace")} if thought is not None else {}
        if image_request.url_ttl is None:
            data = [{"b64_json": image, **extra} for image in images]
        else:  # kept as files of the store, served by /v1/files/{id}/content
            pngs = [base64.b64decode(image) for image in images]
            urls = await files.store_images(request.app.state.store, caller.owner, pngs, image_request.url_ttl, request)
            data = [{"url": url, **extra} for url in urls]
        return {"created": int(time.time()), "data": data, "output_format": "png", "size": image_request.size,
                "usage": NO_USAGE}

    app.include_router(v1)
    app.include_router(make_router(read_json, authorize, keys))
    app.include_router(chat.make_router(read_json, authorize, keys))
    app.include_router(videos.make_router(read_json, read_form, authorize, keys))
    app.include_router(files.make_router(authorize))
    return app


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The body, refused with 413 past `max_bytes` and 408 when it takes over `timeout_s`. A body over the limit
    is read and dropped first, up to twice `max_bytes` (at least MAX_DISCARD_BYTES) and for at most
    DRAIN_TIMEOUT_S when Content-Length announced it, so that a client still sending reads the 413 instead of a
    reset connection (uvicorn closes a connection whose body it did not read); one announced larger still is
    refused unread. A client gone meanwhile ends the request quietly: its answer goes nowhere, and Starlette's
    ClientDisconnect would log a traceback per client."""
    too_large = OpenAIError(413, f"the request body is over {max_bytes} bytes", code="body_too_large")
    discard = max(MAX_DISCARD_BYTES, 2 * max_bytes)
    length = request.headers.get("content-length", "")
    declared = int(length) if length.isdecimal() else 0
    if declared > discard:
        raise too_large
    data, received = bytearray(), 0
    try:
        async with asyncio.timeout(timeout_s if declared <= max_bytes else min(timeout_s, DRAIN_TIMEOUT_S)):
            async for chunk in request.stream():
                received += len(chunk)
                if received > discard:
                    raise too_large
                if received <= max_bytes and declared <= max_bytes:
                    data += chunk
    except TimeoutError:
        if received > max_bytes or declared > max_bytes:
            raise too_large from None
        raise OpenAIError(408, f"the request body took over {timeout_s:g} s", code="timeout") from None
    except ClientDisconnect:
        raise OpenAIError(499, "the client went away during the request body", code="cancelled") from None
    if received > max_bytes or declared > max_bytes:
        raise too_large
    return bytes(data)


async def read_json(request: Request) -> Any:
    """The JSON body (read_body within MAX_BODY_BYTES and BODY_TIMEOUT_S), 400 when it is not JSON (or nests too
    deep) or holds text that is not Unicode (a lone surrogate; naming the field)."""
    data = await read_body(request, MAX_BODY_BYTES, BODY_TIMEOUT_S)
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        raise OpenAIError(400, "the request body is not JSON (or nests too deep)", code="invalid_json") from None
    field = lone_surrogate_field(body)
    if field is not None:
        raise bad_request(f"input '{field}': holds a lone surrogate (an unpaired \\ud800-\\udfff escape), "
                          f"which is not Unicode text", field)
    return body


async def read_form(request: Request) -> tuple[list[tuple[str, str]], list[tuple[str, bytes]]]:
    """A multipart/form-data body (read_body within MAX_EDIT_BODY_BYTES and EDIT_BODY_TIMEOUT_S) as its text fields
    and its files, each (name, value) in order; 400 when it is no such form, 413 for a file over MAX_IMAGE_BYTES or
    the file that takes the files past MAX_EDIT_FILES_BYTES."""
    data = await read_body(request, MAX_EDIT_BODY_BYTES, EDIT_BODY_TIMEOUT_S)  # first: the client reads the answer
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data") or "boundary=" not in content_type:
        raise OpenAIError(400, "the request body must be multipart/form-data (with a boundary)", code="invalid_form")

    async def chunks() -> AsyncIterator[bytes]:
        yield data

    try:
        form = await MultiPartParser(request.headers, chunks(), max_files=MAX_FORM_FILES,
                                     max_fields=MAX_FORM_FIELDS).parse()
    except MultiPartException as exc:
        raise OpenAIError(400, f"the form cannot be read: {exc.message}", code="invalid_form") from None
    fields, files = [], []
    try:
        for name, value in form.multi_items():
            if isinstance(value, str):
                fields.append((name, value))
            else:
                files.append((name, await value.read()))
    finally:
        await form.close()
    total = 0
    for name, file in files:
        total += len(file)
        if len(file) > MAX_IMAGE_BYTES:
            raise OpenAIError(413, f"the file {name!r} is {len(file)} bytes; at most {MAX_IMAGE_BYTES} allowed",
                              param=name.removesuffix("[]"), code="file_too_large")
        if total > MAX_EDIT_FILES_BYTES:
            raise OpenAIError(413, f"the files up to {name!r} are {total} bytes; at most {MAX_EDIT_FILES_BYTES} "
                              f"allowed together", param=name.removesuffix("[]"), code="file_too_large")
    return fields, files


async def ready_models(gateway: TritonGateway) -> list[str]:
    if not await gateway.server_ready():
        raise OpenAIError(503, f"Triton at {gateway.url} is not ready", code="unavailable", type_="server_error")
    return await gateway.ready_models()


async def events(image_request: ImageRequest, first: Response, responses: AsyncIterator[Response], kind: str):
    """Server-sent events: the chosen previews as `<kind>.partial_image`, then each final image as
    `<kind>.completed`."""
    common = {"background": "opaque", "output_format": "png", "quality": "auto", "size": image_request.size}
    targets: Optional[list[int]] = None
    index = 0
    try:
        response: Optional[Response] = first
        while response is not None:
            if targets is None:
                targets = partial_steps(response.num_steps, image_request.partial_images)
            if response.is_final:
                for image in await run_in_threadpool(png_base64, response.images):
                    yield sse(f"{kind}.completed", {"b64_json": image, "created_at": int(time.time()),
                                                             "usage": NO_USAGE, **common})
                return
            if response.images is not None and response.step in targets:
                for image in await run_in_threadpool(png_base64, response.images):
                    yield sse(f"{kind}.partial_image", {"b64_json": image, "created_at": int(time.time()),
                                                                 "partial_image_index": index, **common})
                index += 1
            response = await responses.__anext__()
    except TritonRequestError as exc:
        error = error_from_triton(str(exc))
        yield sse("error", error.body())
    finally:
        await responses.aclose()  # a client that went away cancels the Triton request here


def sse(event: str, data: dict[str, Any]) -> str:
    payload = data if event == "error" else {"type": event, **data}
    return f"event: {event}\ndata: {json.dumps(payload)}\n\n"
