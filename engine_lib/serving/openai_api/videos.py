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
  `frame_rate` for a model that takes one (LTX-2), else the model's: its `default_frame_rate` parameter, else
  its pipeline's (24 for LTX-2 and Helios, 16 for Wan 2.2: interface.VIDEO_FRAME_RATES), sent as the model's
  `frame_rate` when it declares one. The model's own rule on frame counts then decides (LTX-2: 8k + 1, up to
  max_num_frames; Helios: whole chunks; Wan: 4k + 1): "4" is 97 frames at 24 and 65 at 16, which they make;
  a count it refuses is a 400 naming `seconds`;
- `input_reference` (a file): the model's `image` input, for a model that declares one;
- any other field: the model's declared input of that name, as on the images endpoints.

A refusal that comes back within REFUSAL_WAIT_S of the request (the model checks its inputs when
the request arrives; a full queue) is the HTTP error itself, and no job is kept; one that comes
later makes the job `failed` with the same error.

Jobs and their mp4s are kept in the store (store.py: SQLite in DIFFUSION_DATA_DIR, or PostgreSQL for
replicas), so they outlive the front door: any front door on the same store lists, retrieves, downloads
and deletes them. Jobs belong to the bearer key that created them (an open door's callers share them):
another key's job is a 404. A key holds at most MAX_JOBS_PER_CALLER jobs of its own (429 past it). A
finished job expires an hour after it finished (`expires_at`); an expired job is forgotten (404). When the
stored results reach DIFFUSION_DATA_MAX_BYTES (expired ones removed first), new jobs are refused with 507;
a video that cannot be written (a full disk) fails its job. Shutdown cancels every running job's Triton
request and fails the job with "server restarted", as a restart after a crash does.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, AsyncIterator, Callable, Coroutine, Mapping, Optional

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from engine_lib.request import InvalidInputError
from engine_lib.serving.openai_api.gateway import InputType, Response, TritonGateway, TritonRequestError
from engine_lib.serving.openai_api.files import artifact_response
from engine_lib.serving.openai_api.keys import Caller, FrontDoorKeys
from engine_lib.serving.openai_api.requests import (OpenAIError, bad_request, error_from_triton, extra_inputs,
                                                    form_body, lone_surrogate_field, model_and_prompt, parse_size)
from engine_lib.serving.openai_api.store import HEARTBEAT_S, Job, Store, StoreFull, restarted_error

log = logging.getLogger(__name__)

FRAME_RATE = 24  # frames per second `seconds` counts in for a model of no pipeline known here (gateway.py)
DEFAULT_SECONDS = "4"  # OpenAI's default
MAX_JOBS_PER_CALLER = 32
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

    def echo(self) -> dict:
        """What the job's body echoes of its request (kept in the store)."""
        return {"model": self.model, "prompt": self.inputs.get("prompt"), "size": self.size, "seconds": self.seconds}


class VideoJobs:
    """Every caller's jobs, kept in the store (store.py), within the caps (module docstring). The jobs this front
    door runs also have their task here (owned by the event loop's thread)."""

    def __init__(self, store: Store, max_jobs_per_caller: int = MAX_JOBS_PER_CALLER):
        self.store, self.max_jobs_per_caller = store, max_jobs_per_caller
        self._tasks: dict[str, asyncio.Task] = {}
        # Set at the first response (None) or an error before it (the error), for the create request to answer.
        self._first: dict[str, asyncio.Future] = {}

    def owned(self, owner: str) -> list[Job]:
        self.store.sweep()
        return self.store.jobs(owner)

    def get(self, owner: str, video_id: str) -> Job:
        """The caller's job; 404 for one that is not (or no longer) there, or is another caller's."""
        self.store.sweep()
        job = self.store.job(owner, video_id)
        if job is None:
            raise OpenAIError(404, f"no video job {video_id!r} (finished jobs expire {self.store.result_ttl_s:g} s "
                                   f"after they finish)", param="video_id", code="video_not_found")
        return job

    def add(self, owner: str, request: VideoRequest, run: Callable[[Job], Coroutine]) -> Job:
        """A new job of `owner`, run as the task `run(job)`: 429 past the key's own job cap, 507 when the store
        is full."""
        self.store.sweep()
        try:
            self.store.check_room()
        except StoreFull as exc:
            raise OpenAIError(507, str(exc), code="insufficient_storage", type_="server_error") from None
        job = self.store.add_job(owner, request.echo(), self.max_jobs_per_caller)
        if job is None:
            raise OpenAIError(429, f"this key holds {self.max_jobs_per_caller} video jobs, the most it may: delete "
                                   f"finished ones (DELETE /v1/videos/{{id}}) or wait for them to expire",
                              code="too_many_jobs", type_="requests")
        self._first[job.id] = asyncio.get_running_loop().create_future()
        self._tasks[job.id] = asyncio.create_task(run(job))
        return job

    async def refusal(self, job: Job, timeout_s: float) -> Optional[OpenAIError]:
        """The error that ended the job before its model's first response within `timeout_s`, if one did."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._first[job.id]), timeout_s)
        except TimeoutError:
            return None

    def progress(self, job: Job, progress: int) -> None:
        self.store.progress(job.id, progress)
        self._answer(job, None)

    async def complete(self, job: Job, content: bytes) -> None:
        """Keep the job's video (written on a worker thread: a file, flushed to disk)."""
        await run_in_threadpool(self.store.complete, job.id, content, "video/mp4")

    def fail(self, job: Job, error: OpenAIError) -> None:
        self.store.fail(job.id, error_object(error))
        self._answer(job, error)

    def ended(self, job: Job) -> None:
        self._answer(job, None)
        self._first.pop(job.id, None)
        self._tasks.pop(job.id, None)

    def _answer(self, job: Job, error: Optional[OpenAIError]) -> None:
        first = self._first.get(job.id)
        if first is not None and not first.done():
            first.set_result(error)

    async def remove(self, job: Job) -> None:
        """Forget the job and its video; one this front door still runs has its Triton request cancelled first."""
        await self._cancel(job.id)
        self.store.delete_job(job.owner, job.id)

    async def heartbeat(self) -> None:
        """Tell the other front doors on the store, every HEARTBEAT_S, that this one still runs its jobs."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                if self._tasks:
                    self.store.heartbeat(list(self._tasks))
            except Exception as exc:  # noqa: BLE001 - a database away for a while: beat again next time
                log.warning("video jobs' heartbeat not stored: %s", exc)

    async def close(self) -> None:
        """Shutdown: cancel every running job's Triton request; the jobs fail as after a restart."""
        running = list(self._tasks)
        for job_id in running:
            await self._cancel(job_id)
            self.store.fail(job_id, restarted_error())
        if running:
            log.warning("front door shutting down: cancelled %d running video job(s)", len(running))

    async def _cancel(self, job_id: str) -> None:
        task = self._tasks.pop(job_id, None)
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})


def error_object(error: OpenAIError) -> dict:
    return {"code": error.code or "error", "message": error.message, "param": error.param, "type": error.type}


def job_body(job: Job) -> dict:
    """The job as OpenAI's video object."""
    request = job.request
    return {"id": job.id, "object": "video", "model": request["model"], "status": job.status,
            "progress": job.progress, "created_at": int(job.created_at),
            "completed_at": None if job.completed_at is None else int(job.completed_at),
            "expires_at": None if job.expires_at is None else int(job.expires_at), "prompt": request["prompt"],
            "size": request["size"], "seconds": request["seconds"], "remixed_from_video_id": None,
            "error": job.error}


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
                        default_model: Optional[str], model_frame_rate: float) -> VideoRequest:
    """Map a create body (JSON, or a form typed by `form_body`) and its files onto the model's inputs;
    `model_frame_rate`: the model's frames per second when the request sets none (gateway.video_frame_rate)."""
    model, prompt = model_and_prompt(body, default_model)
    inputs: dict[str, Any] = {"prompt": prompt}
    size = body.get("size", "auto")
    width, height = parse_size(size)
    if width is not None:
        inputs.update(width=width, height=height)
    frame_rate = body.get("frame_rate", model_frame_rate) if "frame_rate" in input_types else model_frame_rate
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


async def run_job(job: Job, request: VideoRequest, responses: AsyncIterator[Response], jobs: VideoJobs) -> None:
    """Follow the job's Triton request to its end; cancelling this task cancels the request."""
    try:
        async for response in responses:
            if response.is_final:
                encoded = response.outputs.get("video_mp4")
                if encoded is None or len(encoded) != 1:
                    raise TritonRequestError("INTERNAL: the final response holds no video_mp4")
                await jobs.complete(job, await run_in_threadpool(base64.b64decode, encoded[0]))
                return
            jobs.progress(job, min(99, 100 * response.step // response.num_steps) if response.num_steps else 0)
        raise TritonRequestError("INTERNAL: the model ended the request without a final response")
    except TritonRequestError as exc:
        jobs.fail(job, video_error(str(exc), request))
    finally:
        jobs.ended(job)
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
        frame_rate = await gateway.video_frame_rate(model or default) if model or default else None
        if form:
            body = form_body(fields, input_types)
            surrogate = lone_surrogate_field(body)
            if surrogate is not None:
                raise bad_request(f"input '{surrogate}': holds a lone surrogate, which is not Unicode text", surrogate)
        return parse_video_request(body, files, input_types, default, frame_rate or FRAME_RATE), input_types

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
        job = jobs.add(caller.owner, video, lambda job: run_job(
            job, video, gateway.stream(video.model, tensors, job.id, parameters), jobs))
        refusal = await jobs.refusal(job, REFUSAL_WAIT_S)
        if refusal is not None:  # refused on arrival: the answer, and no job
            await jobs.remove(job)
            raise refusal
        return job_body(jobs.get(caller.owner, job.id))

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
        page = [job_body(job) for job in jobs[:limit]]
        return {"object": "list", "data": page, "has_more": len(jobs) > limit,
                "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}

    @router.get("/{video_id}")
    async def retrieve(video_id: str, request: Request, caller: Caller = Depends(authorize)) -> dict:
        return job_body(request.app.state.videos.get(caller.owner, video_id))

    @router.get("/{video_id}/content")
    async def content(video_id: str, request: Request, variant: str = "video", caller: Caller = Depends(authorize)):
        job = request.app.state.videos.get(caller.owner, video_id)
        if variant != "video":
            raise bad_request(f"variant {variant!r} is not offered here (only video)", "variant")
        if job.artifact is None:
            raise OpenAIError(409, f"video job {video_id} is {job.status}, not completed: no content", param="video_id",
                              code="video_not_ready")
        return artifact_response(request.app.state.videos.store, job.owner, job.artifact)

    @router.delete("/{video_id}")
    async def delete(video_id: str, request: Request, caller: Caller = Depends(authorize)) -> dict:
        jobs: VideoJobs = request.app.state.videos
        await jobs.remove(jobs.get(caller.owner, video_id))
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    return router
