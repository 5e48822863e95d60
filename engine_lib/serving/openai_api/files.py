"""Stored results behind URLs: `GET /v1/files/{id}/content` serves an artifact of the store (store.py), a PNG of an
images request made with `response_format: "url"` (or a video job's mp4, which /v1/videos/{id}/content serves
too), to the bearer key that made it, until it expires (404 after, as for an id that never was).

The URL is under OPENAI_PUBLIC_URL when set (the address clients reach the front door by, behind a proxy or a
load balancer), else under the address the request came to.
"""

from __future__ import annotations

import os
from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from engine_lib.serving.openai_api.keys import Caller
from engine_lib.serving.openai_api.requests import OpenAIError
from engine_lib.serving.openai_api.store import Store, StoreFull


def artifact_response(store: Store, owner: str, artifact_id: str) -> FileResponse:
    """The owner's unexpired artifact as the response body; 404 otherwise."""
    artifact = store.artifact(owner, artifact_id)
    if artifact is None or not store.path(artifact_id).is_file():
        raise OpenAIError(404, f"no file {artifact_id!r} (stored results expire)", param="file_id",
                          code="file_not_found")
    return FileResponse(store.path(artifact_id), media_type=artifact.media_type)


async def store_images(store: Store, owner: str, images: list[bytes], ttl_s: float, request: Request) -> list[str]:
    """Keep each PNG for `ttl_s` and answer its URL; 507 when the store is full or a file cannot be written."""
    base = (os.environ.get("OPENAI_PUBLIC_URL", "").strip() or str(request.base_url)).rstrip("/")
    urls = []
    for image in images:
        try:
            artifact = await run_in_threadpool(store.put_artifact, owner, image, "image/png", ttl_s)
        except StoreFull as exc:
            raise OpenAIError(507, str(exc), code="insufficient_storage", type_="server_error") from None
        except OSError as exc:
            raise OpenAIError(507, f"the image could not be stored in the data directory (DIFFUSION_DATA_DIR): "
                                   f"{exc.strerror or exc}", code="insufficient_storage",
                              type_="server_error") from None
        urls.append(f"{base}/v1/files/{artifact.id}/content")
    return urls


def make_router(authorize) -> APIRouter:
    """The route; `authorize` is the app's bearer key dependency (the caller). The store is `app.state.store`."""
    router = APIRouter(prefix="/v1/files", dependencies=[Depends(authorize)])

    @router.get("/{file_id}/content")
    async def content(file_id: str, request: Request, caller: Caller = Depends(authorize)) -> FileResponse:
        return artifact_response(request.app.state.store, caller.owner, file_id)

    return router
