"""OpenAI's video job API on the front door, for the models with a `video_mp4` output (LTX-2, Helios).

`POST /v1/videos` (a JSON body, or the multipart form the `openai` SDK sends) starts a job: one
Triton request, run by a task of the front door whatever the HTTP client does next, answered at
once with the job (`queued` until the model's first response, then `in_progress` with `progress`
from the step counts, then `completed` or `failed`). `GET /v1/videos/{id}` reads it,
`/content` gives its mp4, `DELETE` cancels its Triton request if it still runs and forgets it,
`GET /v1/videos` lists the caller's jobs.

The fields, as the model gets them:
- `size` "WxH": `width` and `height` (left out: the model's default size, reported as "auto");
- `seconds` (a string, as OpenAI's; default "4"): `num_frames` = seconds x frame rate + 1 (a clip of s
  seconds at r frames per second spans s x r frame intervals). The frame rate is the request's own
  `frame_rate` for a model that takes one (LTX-2), else FRAME_RATE (LTX-2's default, Helios's fixed
  rate), sent as the model's `frame_rate` when it declares one. The model's own rule on frame counts
  then decides (LTX-2: 8k + 1, up to max_num_frames; Helios: whole chunks): "4" is 97 frames, which
  both make; a count it refuses is a 400 naming `seconds`;
- `input_reference` (a file): the model's `image` input, for a model that declares one;
- any other field: the model's declared input of that name, as on the images endpoints.

A refusal that comes back within REFUSAL_WAIT_S of the request (the model checks its inputs when
the request arrives; a full queue) is the HTTP error itself, and no job is kept; one that comes
later makes the job `failed` with the same error.

Jobs belong to the bearer key that created them (an open door's callers share them): another key's
job is a 404. A key holds at most MAX_JOBS_PER_CALLER jobs (429 past it). A finished job expires
RESULT_TTL_S after it finished (`expires_at`), and the finished videos held are at most
MAX_RESULT_BYTES in all (the oldest expire first to make room); an expired job is forgotten (404).
Shutdown cancels every running job's Triton request.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import re
import secrets
import time
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, AsyncIterator, Callable, Mapping, Optional

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response as HTTPResponse
from starlette.concurrency import run_in_threadpool

from engine_lib.request import InvalidInputError
from engine_lib.serving.openai_api.gateway import InputType, Response, TritonGateway, TritonRequestError
from engine_lib.serving.openai_api.keys import Caller, FrontDoorKeys
from engine_lib.serving.openai_api.requests import (OpenAIError, bad_request, error_from_triton, extra_inputs,
                                                    form_body, lone_surrogate_field, model_and_prompt, parse_size)

log = logging.getLogger(__name__)

FRAME_RATE = 24  # frames per second `seconds` counts in, unless the request gives the model a `frame_rate`
DEFAULT_SECONDS = "4"  # OpenAI's default
MAX_JOBS_PER_CALLER = 32
MAX_RESULT_BYTES = 1 << 30  # finished videos held in memory, all callers together
RESULT_TTL_S = 3600.0
REFUSAL_WAIT_S = 0.5
MAX_LIST_LIMIT = 100
VIDEO_FIELDS = ("model", "prompt", "size", "seconds", "input_reference", "user")
# Model inputs the front door sets itself -> the OpenAI field they come from.
VIDEO_INPUTS = {"prompt": "prompt", "width": "size", "height": "size", "num_frames": "seconds",
                "image": "input_reference", "output_format": None, "preview_interval": None}


@dataclass
class VideoRequest:
    """One create request, as the Triton model gets it."""

    model: str
    inputs: dict[str, Any]
    size: str
    seconds: str
    frame_rate: float


@dataclass
class VideoJob:
    id: str
    owner: str
    request: VideoRequest
    created_at: int
    status: str = "queued"
    progress: int = 0
    completed_at: Optional[int] = None
    expires_at: Optional[float] = None
    error: Optional[OpenAIError] = None
    content: Optional[bytes] = None
    task: Optional[asyncio.Task] = None
    answered: asyncio.Event = field(default_factory=asyncio.Event)  # the first response (or the end) came

    @property
    def finished(self) -> bool:
        return self.status in ("completed", "failed")

    def body(self) -> dict:
        error = None if self.error is None else {"code": self.error.code or "error", "message": self.error.message,
                                                  "param": self.error.param, "type": self.error.type}
        return {"id": self.id, "object": "video", "model": self.request.model, "status": self.status,
                "progress": self.progress, "created_at": self.created_at, "completed_at": self.completed_at,
                "expires_at": None if self.expires_at is None else int(self.expires_at),
                "prompt": self.request.inputs.get("prompt"), "size": self.request.size,
                "seconds": self.request.seconds, "remixed_from_video_id": None, "error": error}


class VideoJobs:
    """Every caller's jobs, in creation order, within the caps (module docstring)."""

    def __init__(self, max_jobs_per_caller: int = MAX_JOBS_PER_CALLER, max_result_bytes: int = MAX_RESULT_BYTES,
                 result_ttl_s: float = RESULT_TTL_S, clock: Callable[[], float] = time.time):
        self.max_jobs_per_caller, self.max_result_bytes, self.result_ttl_s = (max_jobs_per_caller, max_result_bytes,
                                                                              result_ttl_s)
        self.clock = clock
        self._jobs: dict[str, VideoJob] = {}

    @property
    def result_bytes(self) -> int:
        return sum(len(job.content) for job in self._jobs.values() if job.content is not None)

    def expire(self) -> None:
        """Forget the finished jobs past their `expires_at`."""
        now = self.clock()
        for job in [j for j in self._jobs.values() if j.expires_at is not None and j.expires_at <= now]:
            del self._jobs[job.id]

    def owned(self, owner: str) -> list[VideoJob]:
        self.expire()
        return [job for job in self._jobs.values() if job.owner == owner]

    def get(self, owner: str, video_id: str) -> VideoJob:
        """The caller's job; 404 for one that is not (or no longer) there, or is another caller's."""
        self.expire()
        job = self._jobs.get(video_id)
        if job is None or job.owner != owner:
            raise OpenAIError(404, f"no video job {video_id!r} (finished jobs expire {self.result_ttl_s:g} s after "
                                   f"they finish)", param="video_id", code="video_not_found")
        return job

    def add(self, owner: str, request: VideoRequest) -> VideoJob:
        if len(self.owned(owner)) >= self.max_jobs_per_caller:
            raise OpenAIError(429, f"this key holds {self.max_jobs_per_caller} video jobs, the most it may: delete "
                                   f"finished ones (DELETE /v1/videos/{{id}}) or wait for them to expire",
                              code="too_many_jobs", type_="requests")
        job = VideoJob(f"video_{secrets.token_hex(16)}", owner, request, int(self.clock()))
        self._jobs[job.id] = job
        return job

    def complete(self, job: VideoJob, content: bytes) -> None:
        """Hold the job's video, making room within max_result_bytes by expiring the oldest finished videos."""
        if len(content) > self.max_result_bytes:
            return self.fail(job, OpenAIError(500, f"the video is {len(content)} bytes, over the "
                                                   f"{self.max_result_bytes} this front door holds",
                                              code="result_too_large", type_="server_error"))
        job.content, job.status, job.progress = content, "completed", 100
        self._finish(job)
        oldest = sorted((j for j in self._jobs.values() if j.content is not None and j is not job),
                        key=lambda j: j.completed_at)
        while self.result_bytes > self.max_result_bytes:
            del self._jobs[oldest.pop(0).id]

    def fail(self, job: VideoJob, error: OpenAIError) -> None:
        job.status, job.error = "failed", error
        self._finish(job)

    def _finish(self, job: VideoJob) -> None:
        now = self.clock()
        job.completed_at, job.expires_at = int(now), now + self.result_ttl_s
        job.answered.set()

    async def remove(self, job: VideoJob) -> None:
        """Forget the job; one still running has its Triton request cancelled first."""
        self._jobs.pop(job.id, None)
        if job.task is not None and not job.task.done():
            job.task.cancel()
            await asyncio.wait({job.task})

    async def close(self) -> None:
        """Shutdown: cancel every running job's Triton request."""
        running = [job for job in self._jobs.values() if not job.finished]
        for job in running:
            await self.remove(job)
        if running:
            log.warning("front door shutting down: cancelled %d running video job(s)", len(running))


def parse_seconds(value: Any, frame_rate: float) -> tuple[str, int]:
    """(seconds as text, num_frames): seconds x frame_rate + 1 frames; 400 naming `seconds` for what is not a
    positive number of seconds spanning whole frames."""
    text = value if isinstance(value, str) else None if isinstance(value, bool) else str(value)
    try:
        seconds = Decimal(text) if text is not None and len(text) <= 16 else None
    except InvalidOperation:
        seconds = None
    if seconds is None or not seconds.is_finite() or seconds <= 0:
        raise bad_request(f"seconds {value!r} is not a positive number of seconds, e.g. '4'", "seconds")
    intervals = seconds * Decimal(repr(frame_rate))
    if intervals != intervals.to_integral_value():
        raise bad_request(f"seconds {text} at {frame_rate:g} frames per second is {intervals} frame intervals, not "
                          f"a whole number", "seconds")
    return text, int(intervals) + 1


def parse_video_request(body: Any, files: list[tuple[str, bytes]], input_types: Mapping[str, InputType],
                        default_model: Optional[str]) -> VideoRequest:
    """Map a create body (JSON, or a form typed by `form_body`) and its files onto the model's inputs."""
    model, prompt = model_and_prompt(body, default_model)
    inputs: dict[str, Any] = {"prompt": prompt}
    size = body.get("size", "auto")
    width, height = parse_size(size)
    if width is not None:
        inputs.update(width=width, height=height)
    frame_rate = body.get("frame_rate", FRAME_RATE) if "frame_rate" in input_types else FRAME_RATE
    if isinstance(frame_rate, bool) or not isinstance(frame_rate, (int, float)) or not 0 < frame_rate < 1e4:
        raise bad_request(f"frame_rate {frame_rate!r} is not a positive number", "frame_rate")
    seconds, inputs["num_frames"] = parse_seconds(body.get("seconds", DEFAULT_SECONDS), frame_rate)
    if "frame_rate" in input_types:
        inputs["frame_rate"] = frame_rate
    for name in ("output_format", "preview_interval"):
        if name in input_types:
            inputs[name] = "mp4" if name == "output_format" else 1  # progress at every step
    if "input_reference" in body:
        raise bad_request("input_reference must be an image file (a multipart file part)", "input_reference")
    for name, data in files:
        if name != "input_reference":
            raise bad_request(f"{name!r} is a file; only input_reference takes one", name)
        if "image" not in input_types:
            raise bad_request(f"{model} takes no input_reference: it does not declare an image input",
                              "input_reference")
        if "image" in inputs:
            raise bad_request("input_reference takes one image file", "input_reference")
        inputs["image"] = data
    own = VIDEO_FIELDS + (("frame_rate",) if "frame_rate" in input_types else ())  # frame_rate: read above
    inputs.update(extra_inputs(body, own, VIDEO_INPUTS, input_types, model))
    return VideoRequest(model, inputs, size if isinstance(size, str) else str(size), seconds, frame_rate)


def video_error(message: str, request: VideoRequest) -> OpenAIError:
    """A Triton error naming the OpenAI field its input came from (num_frames: seconds, with the frames it was)."""
    error = error_from_triton(message)
    named = re.search(r"input '([^']+)'", message)
    if named and named.group(1) in VIDEO_INPUTS:
        error.param = VIDEO_INPUTS[named.group(1)]
        if named.group(1) == "num_frames":
            error.message = (f"seconds {request.seconds} is {request.inputs['num_frames']} frames at "
                             f"{request.frame_rate:g} frames per second (seconds x frame rate + 1), which "
                             f"{request.model} refuses: {error.message}")
    return error


async def run_job(job: VideoJob, responses: AsyncIterator[Response], jobs: VideoJobs) -> None:
    """Follow the job's Triton request to its end; cancelling this task cancels the request."""
    try:
        async for response in responses:
            if response.is_final:
                encoded = response.outputs.get("video_mp4")
                if encoded is None or len(encoded) != 1:
                    raise TritonRequestError("INTERNAL: the final response holds no video_mp4")
                jobs.complete(job, await run_in_threadpool(base64.b64decode, encoded[0]))
                return
            job.status = "in_progress"
            job.progress = min(99, 100 * response.step // response.num_steps) if response.num_steps else 0
            job.answered.set()
        raise TritonRequestError("INTERNAL: the model ended the request without a final response")
    except TritonRequestError as exc:
        jobs.fail(job, video_error(str(exc), job.request))
    finally:
        job.answered.set()
        await responses.aclose()  # cancels the Triton request if it still runs


async def video_models(gateway: TritonGateway) -> list[str]:
    """The ready models that make mp4 videos (a `video_mp4` output)."""
    if not await gateway.server_ready():
        raise OpenAIError(503, f"Triton at {gateway.url} is not ready", code="unavailable", type_="server_error")
    return await gateway.ready_models(output="video_mp4")


def make_router(read_json, read_form, authorize, keys: FrontDoorKeys) -> APIRouter:
    """The endpoints; `read_json` and `read_form` are the app's bounded body readers, `authorize` its bearer key
    dependency (the caller), `keys` the callers' priority rights. The jobs are `app.state.videos`."""
    router = APIRouter(prefix="/v1/videos", dependencies=[Depends(authorize)])

    async def read_create(request: Request, gateway: TritonGateway) -> tuple[VideoRequest, dict[str, InputType]]:
        """The create request (JSON or a form) and its model's declared inputs."""
        form = request.headers.get("content-type", "").lower().startswith("multipart/form-data")
        if form:
            fields, files = await read_form(request)
            model = next((value for name, value in fields if name == "model"), None)
        else:
            body, files = await read_json(request), []
            model = body.get("model") if isinstance(body, dict) else None
        names = await video_models(gateway)
        if model is not None and model not in names:
            raise OpenAIError(404, f"model {model!r} is not a video model served here (video models: "
                                   f"{', '.join(names) or 'none'})", param="model", code="model_not_found")
        default = names[0] if len(names) == 1 else None
        input_types = await gateway.input_types(model or default) if model or default else {}
        if form:
            body = form_body(fields, input_types)
            surrogate = lone_surrogate_field(body)
            if surrogate is not None:
                raise bad_request(f"input '{surrogate}': holds a lone surrogate, which is not Unicode text", surrogate)
        return parse_video_request(body, files, input_types, default), input_types

    @router.post("")
    async def create(request: Request, caller: Caller = Depends(authorize)) -> dict:
        gateway: TritonGateway = request.app.state.gateway
        jobs: VideoJobs = request.app.state.videos
        video, input_types = await read_create(request, gateway)
        try:
            tensors = gateway.tensors(video.inputs, input_types)
        except InvalidInputError as exc:
            raise bad_request(str(exc), VIDEO_INPUTS.get(exc.input_name, exc.input_name)) from None
        parameters = keys.priority_parameters(caller, video.inputs.get("priority"),
                                              await gateway.default_priority(video.model))
        job = jobs.add(caller.owner, video)
        job.task = asyncio.create_task(run_job(job, gateway.stream(video.model, tensors, job.id, parameters), jobs))
        try:
            await asyncio.wait_for(job.answered.wait(), REFUSAL_WAIT_S)
        except TimeoutError:
            pass
        if job.status == "failed":  # refused on arrival: the answer, and no job
            await jobs.remove(job)
            raise job.error
        return job.body()

    @router.get("")
    async def listing(request: Request, after: Optional[str] = None, limit: str = "20", order: str = "desc",
                      caller: Caller = Depends(authorize)) -> dict:
        if not limit.isdecimal() or not 1 <= int(limit) <= MAX_LIST_LIMIT:  # a str: FastAPI's own check is a 422
            raise bad_request(f"limit must be an integer in [1, {MAX_LIST_LIMIT}]", "limit")
        limit = int(limit)
        if order not in ("asc", "desc"):
            raise bad_request("order must be asc or desc", "order")
        jobs = request.app.state.videos.owned(caller.owner)
        jobs = jobs[::-1] if order == "desc" else jobs
        if after is not None:
            ids = [job.id for job in jobs]
            if after not in ids:
                raise bad_request(f"after {after!r} is no video job of this key", "after")
            jobs = jobs[ids.index(after) + 1:]
        page = [job.body() for job in jobs[:limit]]
        return {"object": "list", "data": page, "has_more": len(jobs) > limit,
                "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}

    @router.get("/{video_id}")
    async def retrieve(video_id: str, request: Request, caller: Caller = Depends(authorize)) -> dict:
        return request.app.state.videos.get(caller.owner, video_id).body()

    @router.get("/{video_id}/content")
    async def content(video_id: str, request: Request, variant: str = "video", caller: Caller = Depends(authorize)):
        job = request.app.state.videos.get(caller.owner, video_id)
        if variant != "video":
            raise bad_request(f"variant {variant!r} is not offered here (only video)", "variant")
        if job.content is None:
            raise OpenAIError(409, f"video job {video_id} is {job.status}, not completed: no content", param="video_id",
                              code="video_not_ready")
        return HTTPResponse(job.content, media_type="video/mp4")

    @router.delete("/{video_id}")
    async def delete(video_id: str, request: Request, caller: Caller = Depends(authorize)) -> dict:
        jobs: VideoJobs = request.app.state.videos
        await jobs.remove(jobs.get(caller.owner, video_id))
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    return router
