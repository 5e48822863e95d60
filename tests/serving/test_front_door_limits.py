"""The front door's connection limits (engine_lib/serving/openai_api/http_limits.py) on a real uvicorn server in
this process, with a header timeout short enough to wait for: connections that send nothing, or dribble their
headers, are closed; a request being answered is not, however long it takes. (A body declared over the limit
gets its 413 at once: tests/serving/test_supervision.py, on the launcher's front door.)"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn

from engine_lib.serving.processes import free_port
from engine_lib.serving.openai_api.http_limits import HeaderTimeoutProtocol

HEADER_TIMEOUT_S = 0.5
SLOW_ANSWER_S = 3 * HEADER_TIMEOUT_S


class ShortHeaderTimeout(HeaderTimeoutProtocol):
    header_timeout_s = HEADER_TIMEOUT_S


async def app(scope, receive, send) -> None:
    """Answers "ok"; /slow after SLOW_ANSWER_S."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(SLOW_ANSWER_S)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def port():
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), http=ShortHeaderTimeout,
                                          timeout_keep_alive=60, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield server.config.port
    server.should_exit = True
    thread.join(10)


def closed_while_dribbling(connection: socket.socket, first: bytes = b"GET / HTTP/1.1\r\n") -> int:
    """Send `first`, then one header line every 0.1 s, never the blank line that ends them, until the server
    closes the connection; the lines it took (at most 100: 10 s)."""
    connection.sendall(first)
    connection.settimeout(0.1)
    for line in range(100):
        try:
            if connection.recv(1024) == b"":
                return line
        except socket.timeout:
            pass
        except ConnectionError:
            return line
        try:
            connection.sendall(b"X-Slow: %d\r\n" % line)
        except ConnectionError:
            return line
    raise AssertionError("still open after 10 s of dribbled headers")


def request(connection: socket.socket, path: str = "/") -> bytes:
    connection.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
    connection.settimeout(10)
    reply = b""
    while not reply.endswith(b"ok"):
        chunk = connection.recv(1024)
        assert chunk, f"closed after {reply!r}"
        reply += chunk
    return reply


def test_a_connection_that_sends_nothing_is_closed(port):
    with socket.create_connection(("127.0.0.1", port)) as connection:
        connection.settimeout(10)
        assert connection.recv(1024) == b""


def test_dribbled_headers_are_cut_before_and_after_a_response(port):
    with socket.create_connection(("127.0.0.1", port)) as connection:
        assert closed_while_dribbling(connection) < 20
    with socket.create_connection(("127.0.0.1", port)) as connection:
        assert request(connection).startswith(b"HTTP/1.1 200")
        # the next request on the keep-alive connection (whose own idle limit here is 60 s) dribbles too
        assert closed_while_dribbling(connection) < 20


def test_a_slow_answer_and_the_next_request_on_its_connection_are_served(port):
    with socket.create_connection(("127.0.0.1", port)) as connection:
        assert request(connection, "/slow").startswith(b"HTTP/1.1 200")
        assert request(connection).startswith(b"HTTP/1.1 200")
