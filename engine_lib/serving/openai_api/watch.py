"""Waiting for a streamed request's responses while watching its HTTP client.

Shared by both front doors (OpenAI and generate); each passes how a Triton error
message becomes its own error (`on_error`).
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from fastapi import Request

from engine_lib.serving.openai_api.gateway import Response, TritonRequestError

DISCONNECT_POLL_S = 0.5


async def until_final(responses: AsyncIterator[Response], request: Request,
                      on_error: Callable[[str], Exception]) -> Response:
    """The final response (see `next_response`)."""
    return await next_response(responses, request, on_error, final=True)


async def next_response(responses: AsyncIterator[Response], request: Request,
                        on_error: Callable[[str], Exception], final: bool = False) -> Response:
    """The next response (with `final`: the final one); if the HTTP client leaves meanwhile, cancel the
    Triton request. Errors are raised as `on_error(Triton's message)`."""
    async def read() -> Response:
        async for response in responses:
            if response.is_final or not final:
                return response
        raise on_error("INTERNAL: the model ended the request without a final response")

    task = asyncio.ensure_future(read())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                await asyncio.wait({task})
                await responses.aclose()  # cancels the Triton request
                raise on_error("CANCELLED: the client went away")
        return task.result()
    except TritonRequestError as exc:
        raise on_error(str(exc)) from None
    finally:
        if not task.done():
            task.cancel()
