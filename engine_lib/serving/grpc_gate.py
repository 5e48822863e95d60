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
codes and details on the way back. A client that cancels or goes away cancels the upstream
call, so the model aborts its request; an upstream call that ends ends the client's.

It is asyncio (grpc.aio): an open stream costs no thread. Idle connections are closed, and
keepalive pings find clients that vanished without closing (their calls are then cancelled).

    GRPC_MAX_MESSAGE_BYTES=16777216 python -m engine_lib.serving.grpc_gate --listen 0.0.0.0:8001 \
        --upstream 127.0.0.1:18001

The launcher (launcher.py, `GrpcGate`) runs it; see docs/serving.md, Security.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import AsyncIterator, Optional, Sequence

import grpc
from tritonclient.grpc import service_pb2

MAX_MESSAGE_ENV = "GRPC_MAX_MESSAGE_BYTES"
READY_FD_ENV = "GRPC_GATE_READY_FD"  # a pipe the gate writes "ready" to once it listens (launcher.GrpcGate)
# A request is a prompt and a few numbers (kilobytes; no model takes an image or a tensor input),
# so 16 MiB is a thousand times any real one, and a quarter of the stub's first shared-memory
# region (launcher.DEFAULT_SHM_BYTES, 64 MiB): requests the gate lets through never make it grow.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
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
_UPSTREAM_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


def max_message_bytes(environ=os.environ) -> int:
    """GRPC_MAX_MESSAGE_BYTES, or the default when unset; 0 means no gate (the launcher's choice)."""
    value = environ.get(MAX_MESSAGE_ENV, "").strip()
    if value and not (value.isdigit() and int(value) < 2**31):  # grpc takes an int32
        raise ValueError(f"{MAX_MESSAGE_ENV} must be 0 (no gate) or a number of bytes below 2^31, got {value!r}")
    return int(value) if value else DEFAULT_MAX_MESSAGE_BYTES


def forwarded_metadata(metadata: Optional[Sequence[tuple[str, str | bytes]]]) -> tuple:
    """The caller's metadata that can be sent on: without the pseudo-headers, grpc-* and hop-by-hop ones."""
    return tuple((key, value) for key, value in metadata or ()
                 if not key.startswith((":", "grpc-")) and key not in _HOP_BY_HOP)


class Forwarder(grpc.GenericRpcHandler):
    """Every method of inference.GRPCInferenceService, forwarded as bytes over one channel to `upstream`."""

    def __init__(self, upstream: str):
        self.channel = grpc.aio.insecure_channel(upstream, options=_UPSTREAM_OPTIONS)
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
            # The client's request iterator is the upstream call's: grpc.aio sends each message on as it
            # arrives, half-closes when the client does, and cancels the upstream call if reading fails.
            call = upstream(requests, metadata=forwarded_metadata(context.invocation_metadata()),
                            timeout=context.time_remaining())
            try:
                async for response in call:
                    yield response
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "")
            finally:
                call.cancel()

        return forward


async def serve(listen: str, upstream: str, max_message: int, grace_s: float = 5.0) -> None:
    """Serve until SIGTERM or SIGINT, then give open calls `grace_s` to end and cancel the rest."""
    forwarder = Forwarder(upstream)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message), *_SERVER_OPTIONS])
    server.add_generic_rpc_handlers((forwarder,))
    try:
        server.add_insecure_port(listen)
    except RuntimeError as exc:  # the port is taken, or not an address
        raise SystemExit(f"grpc gate: {exc}") from None
    await server.start()
    print(f"grpc gate: {listen} -> {upstream}, messages up to {max_message} bytes", flush=True)
    ready_fd = os.environ.pop(READY_FD_ENV, "")
    if ready_fd:
        os.write(int(ready_fd), b"ready")
        os.close(int(ready_fd))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace_s)
    await forwarder.channel.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine_lib.serving.grpc_gate", description=__doc__.split("\n")[0])
    parser.add_argument("--listen", required=True, help="address:port the gate listens on")
    parser.add_argument("--upstream", required=True, help="tritonserver's gRPC address:port")
    args = parser.parse_args(argv)
    try:
        limit = max_message_bytes()
    except ValueError as exc:
        print(f"grpc gate: {exc}", file=sys.stderr, flush=True)
        return 2
    if limit == 0:
        print(f"grpc gate: {MAX_MESSAGE_ENV}=0 means no gate", file=sys.stderr, flush=True)
        return 2
    asyncio.run(serve(args.listen, args.upstream, limit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
