"""HTTP transport: Triton's `generate_stream` endpoint (server-sent events).

Inputs travel as JSON fields named like the model inputs; each response is
one `data:` event whose fields are the outputs. Closing the connection is how
an HTTP client gives up on a request.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from typing import Any, Dict, Iterator, Optional, Tuple, Union
from urllib.parse import quote

from client.decode import decode_response
from client.events import (
    Final,
    Progress,
    RequestTimeoutError,
    ResponseFormatError,
    ServerError,
    ServerUnreachableError,
)
from client.sse import iter_sse_data


def split_url(url: str, default_port: int) -> Tuple[str, int]:
    """`host:port`, optionally with an http:// scheme, as (host, port)."""
    for scheme in ("http://", "https://"):
        if url.startswith(scheme):
            url = url[len(scheme):]
    url = url.rstrip("/")
    host, sep, port = url.rpartition(":")
    if not sep or not port.isdigit():
        return url, default_port
    return host.strip("[]"), int(port)


def _error_message(body: bytes) -> str:
    """Triton's message from a failed reply: a JSON error object, bare or as an SSE event."""
    text = body.decode("utf-8", "replace").strip()
    for candidate in [text, *iter_sse_data(text.splitlines())]:
        try:
            return str(json.loads(candidate)["error"])
        except (ValueError, KeyError, TypeError):
            continue
    return text


def http_events(
    url: str, model: str, inputs: Dict[str, Any], timeout: Optional[float]
) -> Iterator[Union[Progress, Final]]:
    """POST one request to generate_stream and yield its events until the final one."""
    host, port = split_url(url, 8000)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        try:
            conn.request(
                "POST",
                f"/v2/models/{quote(model)}/generate_stream",
                body=json.dumps(inputs),
                headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
            )
            response = conn.getresponse()
        except (ConnectionError, socket.gaierror, socket.timeout, OSError) as exc:
            raise ServerUnreachableError(f"cannot reach Triton at {url} over HTTP: {exc}") from None
        if response.status != 200:
            raise ServerError(_error_message(response.read()), status=str(response.status))
        final_seen = False
        try:
            for data in iter_sse_data(response):
                try:
                    message = json.loads(data)
                except ValueError:
                    raise ResponseFormatError(f"the server sent an event that is not JSON: {data[:200]!r}") from None
                if "error" in message:
                    raise ServerError(str(message["error"]))
                event = decode_response(message, is_last=False)
                if event is not None:
                    final_seen = final_seen or isinstance(event, Final)
                    yield event
                if deadline is not None and time.monotonic() > deadline:
                    raise RequestTimeoutError("no final response before the client timeout")
        except (ConnectionError, http.client.IncompleteRead) as exc:
            raise ServerUnreachableError(f"lost the connection to Triton at {url}: {exc}") from None
        if not final_seen:
            raise ServerError("the server ended the stream without a final image")
    finally:
        conn.close()
