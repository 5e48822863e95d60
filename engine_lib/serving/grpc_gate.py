"""The gRPC gate: a small proxy in front of tritonserver's gRPC port that refuses oversized messages.

tritonserver 2.51 has no limit on a gRPC message's size: a 400 MB prompt is refused by the
model, but only after tritonserver copied it (it grew by 1 GB) and the Python stub's shared
memory grew to 640 MiB and stayed there (measured). The gate bounds a message where its bytes
first arrive: grpc core refuses one over `GRPC_MAX_MESSAGE_BYTES` from its length prefix, with
RESOURCE_EXHAUSTED naming the limit, before tritonserver sees a byte of it.

Everything else passes through unchanged: every method of inference.GRPCInferenceService is
forwarded byte for byte (no (de)serialization: unary calls as unary calls, ModelStreamInfer as
a bidirectional stream) to tritonserver's own gRPC port on loopback, with the caller's metadata
(the `admin-key` header of the repository API, say), its deadline, and tritonserver's status
codes and details on the way back. A client that cancels or goes away with a request still open
cancels the upstream call, so the model aborts its request; an upstream call that ends ends the
client's. A stream whose requests all have their finals is never cancelled upstream, but half-closed
(ended as a client that is done ends it): cancelling it sent tritonserver 2.51 a cancellation for
requests that had ended, and after 30 such streams the model never unloaded at the next stop while
requests ran (measured: "still loaded after 8 s", finalize() never called; half-closed, it unloads).

It is asyncio (grpc.aio): an open stream costs no thread. Idle connections are closed, and
keepalive pings find clients that vanished without closing (their calls are then cancelled).

A stream's responses are read from tritonserver as fast as it sends them, whatever the client does
(`GateStream`): a client that stops reading made tritonserver buffer every preview it was sent
(87 to 380 MB in 44 s, never released; measured while the gate read only as fast as its client). The gate keeps at most
`GRPC_MAX_UNSENT_BYTES` of one stream's responses unsent and drops intermediate ones (previews,
progress, video chunks, all of which the final repeats or outdates) over that; finals and errors always go out.

On SIGTERM the gate refuses new calls, ends every stream without an open request at once, and the
others as soon as their requests have their finals; requests still open after `--drain-s` get an
UNAVAILABLE final made here ("server shutting down") and are cancelled upstream. tritonserver then has
no client stream left, so the models unload (the launcher's stop) instead of waiting for idle streams.
SIGUSR1 does the same to the streams open at that moment and keeps serving: tritonserver is shutting down
on a signal of its own (the launcher's supervisor restarts it), and its running requests must end before
its exit timeout expires, or it tears its stubs down under them and crashes.

    GRPC_MAX_MESSAGE_BYTES=16777216 python -m engine_lib.serving.grpc_gate --listen 0.0.0.0:8001 \
        --upstream 127.0.0.1:18001

The launcher (serve.py, with processes.GrpcGate) runs it; see docs/serving.md, Security.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections import Counter, deque
from typing import AsyncIterator, Optional, Sequence

import grpc
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

from engine_lib.request import EngineUnavailableError
from engine_lib.serving.sender import error_message

MAX_MESSAGE_ENV = "GRPC_MAX_MESSAGE_BYTES"
READY_FD_ENV = "GRPC_GATE_READY_FD"  # a pipe the gate writes "ready" to once it listens (processes.GrpcGate)
# A request is a prompt and a few numbers (kilobytes; no model takes an image or a tensor input),
# so 16 MiB is a thousand times any real one, and a quarter of the stub's first shared-memory
# region (tritonserver.DEFAULT_SHM_BYTES, 64 MiB): requests the gate lets through never make it grow.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_UNSENT_ENV = "GRPC_MAX_UNSENT_BYTES"
# Per stream: two 1024x1024 raw previews of one image (3 MiB each) fit; one larger response still goes out
# whenever nothing else of its stream waits, so a reader that keeps up never misses one.
DEFAULT_MAX_UNSENT_BYTES = 8 * 1024 * 1024
DEFAULT_DRAIN_S = 25.0  # the launcher passes its own (EXIT_TIMEOUT_SECS less the time the models take to unload)
SHUTTING_DOWN = EngineUnavailableError("server shutting down")
SERVICE = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
# Headers grpc sets itself on each call and refuses as metadata (pseudo-headers, grpc-*, these).
_HOP_BY_HOP = {"te", "content-type", "user-agent", "host", "connection", "keep-alive", "proxy-connection",
               "transfer-encoding", "upgrade"}
_SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a second process on the port fails to start instead of sharing its calls
    ("grpc.max_send_message_length", -1),  # responses (images, videos) are tritonserver's to size
    ("grpc.max_connection_idle_ms", 5 * 60_000),  # a connection without calls is closed after 5 min
    ("grpc.server_handshake_timeout_ms", 20_000),  # one that never finishes its HTTP/2 preface: 20 s
    ("grpc.keepalive_time_ms", 60_000),  # ping every client each minute; one that does not answer
    ("grpc.keepalive_timeout_ms", 20_000),  # within 20 s is gone: its calls are cancelled upstream too
    ("grpc.http2.max_pings_without_data", 0),  # keep pinging through a silent minutes-long denoise
]
# After a restart of tritonserver the gate reconnects within a second of its port opening (grpc's default
# backoff grows to 120 s between attempts: requests failed for up to 7.7 s after the server was ready).
_UPSTREAM_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1),
                     ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 1000)]


def max_message_bytes(environ=os.environ) -> int:
    """GRPC_MAX_MESSAGE_BYTES, or the default when unset; 0 means no gate (the launcher's choice)."""
    value = environ.get(MAX_MESSAGE_ENV, "").strip()
    if value and not (value.isdigit() and int(value) < 2**31):  # grpc takes an int32
        raise ValueError(f"{MAX_MESSAGE_ENV} must be 0 (no gate) or a number of bytes below 2^31, got {value!r}")
    return int(value) if value else DEFAULT_MAX_MESSAGE_BYTES


def max_unsent_bytes(environ=os.environ) -> int:
    """GRPC_MAX_UNSENT_BYTES, or the default when unset."""
    value = environ.get(MAX_UNSENT_ENV, "").strip()
    if value and not value.isdigit():
        raise ValueError(f"{MAX_UNSENT_ENV} must be a number of bytes, got {value!r}")
    return int(value) if value else DEFAULT_MAX_UNSENT_BYTES


def forwarded_metadata(metadata: Optional[Sequence[tuple[str, str | bytes]]]) -> tuple:
    """The caller's metadata that can be sent on: without the pseudo-headers, grpc-* and hop-by-hop ones."""
    return tuple((key, value) for key, value in metadata or ()
                 if not key.startswith((":", "grpc-")) and key not in _HOP_BY_HOP)


class GateStream:
    """One client's ModelStreamInfer through the gate: its requests still open upstream, and its responses not
    yet written to the client, bounded in bytes.

    `read` takes tritonserver's responses as they come and `responses` writes them to the client as fast as it
    reads. Unsent bytes (queued, and the one being written) stay under `max_unsent` by dropping intermediate
    responses (`dropped` counts them); a final or an error is always queued, and so is any response when
    nothing else is unsent. A response is final when its `triton_final_response` parameter says so, or when it
    has none (a model that is not decoupled answers once). Owned by the event loop: no lock.
    """

    def __init__(self, max_unsent: int):
        self.max_unsent = max_unsent
        self.queue: deque[bytes] = deque()
        self.unsent = 0  # bytes queued or being written
        self.dropped = 0
        self.open: Counter[str] = Counter()  # request id -> requests forwarded whose final has not come back
        self.models: dict[str, str] = {}  # request id -> its model, for a final made here
        self.closing = False  # the gate stops: end once no request is open, forward no new one
        self.ended = False  # nothing more will be queued
        self.done_writing = asyncio.Event()  # forward no more requests: the upstream call is half-closed
        self.error: Optional[grpc.aio.AioRpcError] = None  # how the upstream call ended, if it failed
        self._changed = asyncio.Event()

    async def forwarded(self, requests: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The client's requests, on their way upstream, until the client half-closes or `done_writing` is set;
        while closing, each is answered here instead."""
        incoming = requests.__aiter__()
        while True:
            raw = await self._next_request(incoming)
            if raw is None:
                return
            try:
                request = service_pb2.ModelInferRequest.FromString(raw)
            except DecodeError:
                yield raw  # not tracked: tritonserver refuses it
                continue
            if self.closing:
                self._queue(self.final(request.id, request.model_name, SHUTTING_DOWN))
                continue
            self.open[request.id] += 1
            self.models[request.id] = request.model_name
            yield raw

    async def _next_request(self, incoming) -> Optional[bytes]:
        """The client's next request; None once it half-closed, or once `done_writing` is set first."""
        if self.done_writing.is_set():
            return None
        received = asyncio.ensure_future(incoming.__anext__())
        done_writing = asyncio.ensure_future(self.done_writing.wait())
        try:
            await asyncio.wait((received, done_writing), return_when=asyncio.FIRST_COMPLETED)
        finally:
            done_writing.cancel()
        if not received.done():
            received.cancel()
            return None
        try:
            return received.result()
        except StopAsyncIteration:
            return None

    async def read(self, call) -> None:
        """Queue the upstream call's responses until it ends (its error kept for the client)."""
        try:
            async for raw in call:
                self.receive(raw)
        except grpc.aio.AioRpcError as exc:
            if not self.ended:  # not cut by the gate itself (end_open_requests)
                self.error = exc
        self.ended = True
        self._changed.set()

    def receive(self, raw: bytes) -> None:
        try:
            response = service_pb2.ModelStreamInferResponse.FromString(raw)
        except DecodeError:
            self._queue(raw)  # not ours to judge: passed on, never dropped
            return
        parameters = response.infer_response.parameters
        final = parameters["triton_final_response"].bool_param if "triton_final_response" in parameters else True
        if final:
            self._forget(response.infer_response.id)
        elif self.unsent and self.unsent + len(raw) > self.max_unsent and not response.error_message:
            self.dropped += 1
            return
        self._queue(raw)

    def _queue(self, raw: bytes) -> None:
        if not self.ended:
            self.queue.append(raw)
            self.unsent += len(raw)
            self._changed.set()

    def _forget(self, request_id: str) -> None:
        self.open[request_id] -= 1
        if self.open[request_id] <= 0:
            del self.open[request_id]
            self.models.pop(request_id, None)
        self._changed.set()

    async def responses(self) -> AsyncIterator[bytes]:
        """What the client is sent, in order, until upstream ends or, while closing, no request is open."""
        while True:
            if self.queue:
                raw = self.queue.popleft()
                try:
                    yield raw
                finally:
                    self.unsent -= len(raw)
            elif self.ended or (self.closing and not self.open):
                return
            else:
                self._changed.clear()
                await self._changed.wait()

    def close(self) -> None:
        """The gate stops: the stream ends once its open requests have their finals (at once if none is open)."""
        self.closing = True
        self._changed.set()

    def end_open_requests(self, error: BaseException) -> None:
        """Queue a final with `error` for every request still open, and take nothing more from upstream."""
        for request_id, count in self.open.items():
            for _ in range(count):
                self._queue(self.final(request_id, self.models.get(request_id, ""), error))
        self.open.clear()
        self.ended = True
        self._changed.set()

    @staticmethod
    def final(request_id: str, model: str, error: BaseException) -> bytes:
        """An error final for a request, as tritonserver sends a model's: its message and id, the final flag."""
        response = service_pb2.ModelStreamInferResponse(error_message=error_message(error, request_id)[1])
        response.infer_response.id = request_id
        response.infer_response.model_name = model
        response.infer_response.parameters["triton_final_response"].bool_param = True
        return response.SerializeToString()


class Forwarder(grpc.GenericRpcHandler):
    """Every method of inference.GRPCInferenceService, forwarded as bytes over one channel to `upstream`."""

    def __init__(self, upstream: str, max_unsent: int = DEFAULT_MAX_UNSENT_BYTES):
        self.channel = grpc.aio.insecure_channel(upstream, options=_UPSTREAM_OPTIONS)
        self.max_unsent = max_unsent
        self.streams: set[GateStream] = set()
        self.closing = False
        self._handlers = {}
        for method in SERVICE.methods:
            path = f"/{SERVICE.full_name}/{method.name}"
            if method.client_streaming and method.server_streaming:
                self._handlers[path] = grpc.stream_stream_rpc_method_handler(self._stream(path))
            else:
                assert not (method.client_streaming or method.server_streaming), path
                self._handlers[path] = grpc.unary_unary_rpc_method_handler(self._unary(path))

    def service(self, handler_call_details):
        return self._handlers.get(handler_call_details.method)  # None: UNIMPLEMENTED

    def _unary(self, path: str):
        upstream = self.channel.unary_unary(path)

        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            call = upstream(request, metadata=forwarded_metadata(context.invocation_metadata()),
                            timeout=context.time_remaining())
            try:
                return await call
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "")
            finally:
                call.cancel()  # a no-op once done; the client cancelled or went away otherwise

        return forward

    def _stream(self, path: str):
        upstream = self.channel.stream_stream(path)

        async def forward(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            # grpc.aio sends each request on as it arrives, half-closes when the client does, and cancels the
            # upstream call if reading fails; the responses go through the stream's bounded queue.
            stream = GateStream(self.max_unsent)
            call = upstream(stream.forwarded(requests), metadata=forwarded_metadata(context.invocation_metadata()),
                            timeout=context.time_remaining())
            reader = asyncio.ensure_future(stream.read(call))
            self.streams.add(stream)
            if self.closing:
                stream.close()
            try:
                async for response in stream.responses():
                    yield response
                if stream.error is not None:
                    await context.abort(stream.error.code(), stream.error.details() or "")
            finally:
                self.streams.discard(stream)
                if stream.open:  # the client cancelled or went away, or the drain ended them: the model aborts them
                    reader.cancel()
                    call.cancel()
                else:  # every request has its final: end the upstream call as a client that is done does
                    stream.done_writing.set()
                    asyncio.ensure_future(_end_upstream(call, reader))
                if stream.dropped:
                    print(f"grpc gate: a stream ended with {stream.dropped} intermediate responses dropped: its "
                          f"client read slower than they came ({MAX_UNSENT_ENV}={self.max_unsent})", flush=True)

        return forward

    async def close_streams(self, drain_s: float, stopping: bool = True) -> None:
        """End every stream open now: those without an open request at once, the others when their requests have
        their finals, or after `drain_s` with an UNAVAILABLE final made here for each request still open.
        `stopping`: the gate stops (no new call is served); else new streams are forwarded as before."""
        self.closing = self.closing or stopping
        streams = set(self.streams)
        for stream in streams:
            stream.close()
        deadline = asyncio.get_running_loop().time() + drain_s
        while any(stream.open for stream in streams) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        ended = sum(sum(stream.open.values()) for stream in streams)
        for stream in streams:
            stream.end_open_requests(SHUTTING_DOWN)
        if ended:
            print(f"grpc gate: {ended} requests still running after the {drain_s:g} s drain ended with "
                  f"UNAVAILABLE ({SHUTTING_DOWN})", flush=True)


async def serve(listen: str, upstream: str, max_message: int, max_unsent: int = DEFAULT_MAX_UNSENT_BYTES,
                drain_s: float = DEFAULT_DRAIN_S) -> None:
    """Serve until SIGTERM or SIGINT, then end every stream (Forwarder.close_streams) and exit."""
    forwarder = Forwarder(upstream, max_unsent)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message), *_SERVER_OPTIONS])
    server.add_generic_rpc_handlers((forwarder,))
    try:
        server.add_insecure_port(listen)
    except RuntimeError as exc:  # the port is taken, or not an address
        raise SystemExit(f"grpc gate: {exc}") from None
    await server.start()
    print(f"grpc gate: {listen} -> {upstream}, messages up to {max_message} bytes, "
          f"{max_unsent} bytes unsent per stream", flush=True)
    ready_fd = os.environ.pop(READY_FD_ENV, "")
    if ready_fd:
        os.write(int(ready_fd), b"ready")
        os.close(int(ready_fd))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, lambda: _drain_upstream(forwarder, drain_s))
    await stop.wait()
    print(f"grpc gate: stopping ({len(forwarder.streams)} streams open)", flush=True)
    stopped = asyncio.ensure_future(server.stop(drain_s + 5.0))  # refuses new calls at once
    await forwarder.close_streams(drain_s)
    await stopped  # the finals written (a client that does not read them is cut after 5 s)
    await forwarder.channel.close()


async def _end_upstream(call, reader: asyncio.Future, wait_s: float = 5.0) -> None:
    """A half-closed upstream call ends with tritonserver's status once it has nothing more to send; one that
    does not within `wait_s` is cancelled."""
    try:
        await asyncio.wait_for(asyncio.shield(reader), wait_s)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        pass
    finally:
        reader.cancel()
        call.cancel()  # a no-op once it ended


def _drain_upstream(forwarder: Forwarder, drain_s: float) -> None:
    """SIGUSR1: tritonserver is shutting down; end the streams open now as a stop would, and serve on."""
    print(f"grpc gate: tritonserver is stopping: ending {len(forwarder.streams)} streams within {drain_s:g} s",
          flush=True)
    asyncio.ensure_future(forwarder.close_streams(drain_s, stopping=False))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine_lib.serving.grpc_gate", description=__doc__.split("\n")[0])
    parser.add_argument("--listen", required=True, help="address:port the gate listens on")
    parser.add_argument("--upstream", required=True, help="tritonserver's gRPC address:port")
    parser.add_argument("--drain-s", type=float, default=DEFAULT_DRAIN_S,
                        help="on SIGTERM, how long open requests may still run before they end UNAVAILABLE")
    args = parser.parse_args(argv)
    try:
        limit = max_message_bytes()
        max_unsent = max_unsent_bytes()
    except ValueError as exc:
        print(f"grpc gate: {exc}", file=sys.stderr, flush=True)
        return 2
    if limit == 0:
        print(f"grpc gate: {MAX_MESSAGE_ENV}=0 means no gate", file=sys.stderr, flush=True)
        return 2
    asyncio.run(serve(args.listen, args.upstream, limit, max_unsent, args.drain_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
