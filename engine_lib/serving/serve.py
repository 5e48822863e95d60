"""The launcher's command line (`make serve`, the Docker image): `python -m engine_lib.serving.serve serve`
starts tritonserver (tritonserver.py) under a `Supervisor` (supervisor.py) that restarts a server or stub that
dies, or a server that stops answering, and next to it the gRPC gate and the front door (processes.py); a gate
or front door that exits on its own is started again alone. `... serve ready` is the probes' readiness: exit 0
only while every port serves (`unready_ports`).
Environment: TRITON_ADDRESS (127.0.0.1; 0.0.0.0: the gRPC, metrics and front door ports listen on every
interface), TRITON_HTTP_ADDRESS (tritonserver's HTTP port, which one request can crash: 127.0.0.1 whatever
TRITON_ADDRESS says), HTTP_PORT, GRPC_PORT, METRICS_PORT (8000, 8001, 8002), GRPC_MAX_MESSAGE_BYTES (the
gate's limit on a gRPC message, 16 MiB; 0: no gate, tritonserver's gRPC port is the public one; with the
gate tritonserver's own listens on 127.0.0.1, on a free port), GRPC_MAX_UNSENT_BYTES (the gate's bound on
what one stream holds for a client that reads slowly, 8 MiB), OPENAI_PORT (9000; 0: no front door),
OPENAI_API_KEY (a bearer key the front door asks for), OPENAI_PRIORITY_KEYS (front door bearer keys that
may ask for priority up to a level: `key=1,key2=2`), DIFFUSION_PRIORITY_KEY (the request parameter
`priority_key` a request needs to ask for a priority more urgent than the model's default; default: a
random one per launch; the models and the front door get it in their environment), MODEL_REPOSITORY
(<repo>/model_repository), EXIT_TIMEOUT_SECS (30: the models' unload; the gate's drain 5 s less),
TRITON_ADMIN_KEY (the repository API's key; default: a random one per launch), TRITONSERVER (a
tritonserver binary to use instead of the nvidia-pytriton wheel's, e.g. /opt/tritonserver/bin/tritonserver
in NGC images), MODELS (the models loaded at start: names of the repository's models separated by commas,
or `all`; default qwen_image; `--load-model` takes precedence).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence, TypeVar

from engine_lib.serving.grpc_gate import max_message_bytes
from engine_lib.serving.processes import (DEFAULT_ADDRESS, ChildProcess, GrpcGate, OpenAIFrontDoor, TritonServerError,
                                          connect_host, default_address, env_int, free_port)
from engine_lib.serving.supervisor import LABEL, RESTARTS_ENV, SAMPLE, Backoff, Supervisor
from engine_lib.serving.tritonserver import DEFAULT_MODEL_REPOSITORY, TritonServer

# The gRPC gate's drain ends this long before the unload's wait does: the models' requests it ends are
# cancelled, and the models unload, within it.
GATE_DRAIN_MARGIN_S = 5.0
PRIORITY_KEY_ENV = "DIFFUSION_PRIORITY_KEY"  # the key of priorities above a model's default (serve())
MODELS_ENV = "MODELS"  # the models `make serve` and `make demo` load at start (select_models)
DEFAULT_MODELS = ("qwen_image",)  # one model: the server is ready in seconds; MODELS=all loads every one


def repository_models(repository: os.PathLike | str) -> list[str]:
    """The models of a model repository: its folders that hold a config.pbtxt, sorted."""
    return sorted(p.parent.name for p in Path(repository).glob("*/config.pbtxt"))


def select_models(value: Optional[str | Sequence[str]], repository: os.PathLike | str) -> list[str]:
    """The models to load at start, as `load_models` takes them.

    `value`: names separated by commas or spaces (or a list of such strings), as MODELS or
    `--load-model` give them; `all` (or `*`): every model of the repository (["*"]); empty or
    None: DEFAULT_MODELS. A name that is not a model of `repository` raises TritonServerError
    naming the known ones.
    """
    parts = [value] if isinstance(value, str) or value is None else list(value)
    names = list(dict.fromkeys(n for part in parts for n in (part or "").replace(",", " ").split()))
    if not names:
        names = list(DEFAULT_MODELS)
    if any(n.lower() in ("all", "*") for n in names):
        return ["*"]
    known = repository_models(repository)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise TritonServerError(
            f"unknown model{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} in {repository}; "
            f"known: {', '.join(known) or '(none)'}, or all")
    return names


GATE, FRONT_DOOR = "the gRPC gate", "the front door"  # as the launcher's log names them
Child = TypeVar("Child", bound=ChildProcess)


class Children:
    """The gate and the front door, each started once for the launcher's life (they reconnect to a restarted
    server by themselves), started again alone when it exits (`_restart_when_exits`), stopped after the server."""

    def __init__(self, stop: threading.Event):
        self.stop = stop  # set when one cannot start: the launcher stops
        self.gate: Optional[GrpcGate] = None
        self.front_door: Optional[OpenAIFrontDoor] = None
        self.failed = threading.Event()  # one of them could not start (again)
        self.stopped = threading.Event()  # they are stopped: the threads that restarted them may end

    def start(self, name: str, make: Callable[[], Child]) -> Optional[Child]:
        """The child `make` builds, started and watched; None (and the launcher stops) when it cannot start."""
        try:
            child = make().start()
        except TritonServerError as exc:
            print(f"launcher: {exc}", file=sys.stderr, flush=True)
            self.failed.set()
            self.stop.set()
            return None
        threading.Thread(target=_restart_when_exits, args=(child, name, self.stop, self.failed, self.stopped),
                         daemon=True).start()
        return child

    def stop_all(self) -> None:
        """After the server's drain (running requests came through them), front door first."""
        for name, child in ((FRONT_DOOR, self.front_door), (GATE, self.gate)):
            if child is not None:
                print(f"launcher: stopping {name}", flush=True)
                child.stop()
        self.stopped.set()


def serve(argv: Optional[Sequence[str]] = None) -> int:
    """Run tritonserver (supervised) and the front door in the foreground until Ctrl-C or SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m engine_lib.serving.serve")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="start tritonserver on the model repository and keep it serving")
    p.add_argument("--model-repository", default=None, help="default: $MODEL_REPOSITORY or <repo>/model_repository")
    p.add_argument("--http-port", type=int, default=None, help="default: $HTTP_PORT or 8000")
    p.add_argument("--grpc-port", type=int, default=None, help="default: $GRPC_PORT or 8001")
    p.add_argument("--metrics-port", type=int, default=None, help="default: $METRICS_PORT or 8002")
    p.add_argument("--address", default=None,
                   help="the address the gRPC, metrics and front door ports listen on (tritonserver's HTTP port: "
                        f"$TRITON_HTTP_ADDRESS or {DEFAULT_ADDRESS}); default: $TRITON_ADDRESS or {DEFAULT_ADDRESS}")
    p.add_argument("--log-file", default=None, help="default: the console")
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--load-model", action="append", default=None,
                   help="a model to load at start (repeatable; `all`: every model of the repository); "
                        f"default: ${MODELS_ENV} (names separated by commas, or all) or {','.join(DEFAULT_MODELS)}")
    p.add_argument("--stub-drain", type=float, default=10.0,
                   help="after a stub dies: seconds the other models' running requests get before the restart")
    p.add_argument("--openai-port", type=int, default=None,
                   help="the front door's port (OpenAI Images API, strict generate); default: $OPENAI_PORT or 9000; "
                        "0: none")
    sub.add_parser("ready", help="exit 0 if every port of a running launcher serves (the probes' readiness), "
                                 "else 1 naming those that do not; reads the ports from the environment as serve does")
    args = parser.parse_args(argv)
    if args.command == "ready":
        return _report_ready(unready_ports())
    openai_port = args.openai_port if args.openai_port is not None else env_int("OPENAI_PORT", 9000)
    address = args.address or default_address()
    repository = args.model_repository or os.environ.get("MODEL_REPOSITORY") or DEFAULT_MODEL_REPOSITORY
    try:
        models = select_models(args.load_model or os.environ.get(MODELS_ENV), repository)
    except TritonServerError as exc:
        print(f"launcher: {exc}", file=sys.stderr, flush=True)
        return 2
    admin_key = os.environ.get("TRITON_ADMIN_KEY", "").strip() or secrets.token_urlsafe(24)
    # The key a request needs to ask for more than the model's default priority. tritonserver (so its
    # stubs) and the front door read it from their environment, never from a command line (ps shows those).
    priority_key = os.environ.get(PRIORITY_KEY_ENV, "").strip() or secrets.token_urlsafe(24)
    try:
        max_message = max_message_bytes()
    except ValueError as exc:
        print(f"launcher: {exc}", file=sys.stderr, flush=True)
        return 2
    grpc_port = args.grpc_port or env_int("GRPC_PORT", 8001)
    # With the gate, tritonserver's own gRPC port is internal: loopback, on a port chosen once, so that a
    # restarted server comes back where the gate and the front door look for it.
    internal_grpc_port = free_port() if max_message else grpc_port
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    began = [time.monotonic()]  # when the current server was started (each restart starts anew)

    def make_server(restarts: int) -> TritonServer:
        began[0] = time.monotonic()
        return TritonServer(args.model_repository, http_port=args.http_port, grpc_port=internal_grpc_port,
                            metrics_port=args.metrics_port, address=address,
                            grpc_address=DEFAULT_ADDRESS if max_message else address,
                            log_path=args.log_file or "/dev/stdout", log_verbose=args.log_verbose, admin_key=admin_key,
                            env={RESTARTS_ENV: str(restarts), PRIORITY_KEY_ENV: priority_key}, load_models=models)

    children = Children(stop)

    def drain_gate() -> None:
        """At the stop, while the models unload: the gate ends its client streams (idle ones at once), so
        that none keeps tritonserver's unload waiting, and the requests still running after its drain with
        UNAVAILABLE, before the unload's wait (EXIT_TIMEOUT_SECS) runs out."""
        stop.wait()
        if children.gate is not None:
            children.gate.drain()

    threading.Thread(target=drain_gate, daemon=True).start()
    gate_drain_s = max(1.0, env_int("EXIT_TIMEOUT_SECS", 30) - GATE_DRAIN_MARGIN_S)

    def on_ready(server: TritonServer) -> None:
        if max_message and children.gate is None:
            children.gate = children.start(GATE, lambda: GrpcGate(
                server.grpc_url, address, grpc_port, max_message, log_path=args.log_file, drain_s=gate_drain_s))
            if children.gate is None:
                return
        grpc_url = children.gate.url if max_message else server.grpc_url
        # The front door's requests go through the gate too: at the stop they get the gate's drain and its
        # UNAVAILABLE final like any client's, instead of holding the models' unload past its timeout.
        front_env = {**os.environ, "TRITON_ADMIN_KEY": admin_key, PRIORITY_KEY_ENV: priority_key}
        if openai_port and children.front_door is None:
            children.front_door = children.start(FRONT_DOOR, lambda: OpenAIFrontDoor(
                grpc_url, host=address, port=openai_port, log_path=args.log_file, env=front_env, drain_s=gate_drain_s))
            if children.front_door is None:
                return
        front = f", front door {children.front_door.url}" if openai_port else ""
        print(f"launcher: ready in {time.monotonic() - began[0]:.1f} s (grpc {grpc_url}, http {server.http_url}"
              f"{front}); Ctrl-C stops", flush=True)

    loading = "every model" if models == ["*"] else ", ".join(models)
    print(f"launcher: starting tritonserver on {repository} (address {address}), loading {loading}", flush=True)
    def on_stopping(server: TritonServer) -> None:
        if children.gate is not None:
            children.gate.end_requests()

    supervisor = Supervisor(make_server, stop, on_ready=on_ready, start_timeout_s=args.start_timeout,
                            stub_drain_s=args.stub_drain, on_stopping=on_stopping)
    code = supervisor.run()
    children.stop_all()
    code = 1 if children.failed.is_set() else code
    print(f"launcher: stopped (exit code {code})", flush=True)
    return code


def unready_ports(environ: Mapping[str, str] = os.environ, timeout_s: float = 2.0) -> list[str]:
    """The public ports of a launcher started with `environ` that do not serve now (empty: ready).

    tritonserver's own readiness is not enough: it says ready before the gate and the front door listen, while
    one of them restarts, and (its HTTP port on loopback) says nothing about them, nor about a model whose
    parallel worker group is broken (a Python model cannot change it). So: tritonserver's /v2/health/ready,
    its metrics (no model's diffusion_parallel_workers_down at 1), the gate's port taking a connection, and
    the front door's /health, which answers 200 only while tritonserver is ready through the gate.
    """
    host = connect_host(environ.get("TRITON_ADDRESS", "").strip() or DEFAULT_ADDRESS)
    http_host = connect_host(environ.get("TRITON_HTTP_ADDRESS", "").strip() or DEFAULT_ADDRESS)
    port = lambda name, default: int(environ.get(name, "").strip() or default)  # noqa: E731
    checks = {f"tritonserver (http://{http_host}:{port('HTTP_PORT', 8000)}/v2/health/ready)":
              f"http://{http_host}:{port('HTTP_PORT', 8000)}/v2/health/ready"}
    if environ.get("GRPC_MAX_MESSAGE_BYTES", "").strip() != "0":
        checks[f"the gRPC gate ({host}:{port('GRPC_PORT', 8001)})"] = (host, port("GRPC_PORT", 8001))
    if port("OPENAI_PORT", 9000):
        checks[f"the front door (http://{host}:{port('OPENAI_PORT', 9000)}/health)"] = \
            f"http://{host}:{port('OPENAI_PORT', 9000)}/health"
    metrics = f"http://{host}:{port('METRICS_PORT', 8002)}/metrics"
    unready = []
    try:
        with urllib.request.urlopen(metrics, timeout=timeout_s) as reply:
            samples = SAMPLE.findall(reply.read().decode(errors="replace"))
        unready += [f"the parallel workers of {dict(LABEL.findall(labels)).get('instance', labels)}"
                    for name, labels, value in samples if name == "diffusion_parallel_workers_down" and float(value)]
    except (urllib.error.URLError, OSError):
        unready.append(f"tritonserver's metrics ({metrics})")
    for name, target in checks.items():
        try:
            if isinstance(target, tuple):
                socket.create_connection(target, timeout=timeout_s).close()
            else:
                with urllib.request.urlopen(target, timeout=timeout_s) as reply:
                    if reply.status != 200:
                        unready.append(name)
        except (urllib.error.URLError, OSError):
            unready.append(name)
    return unready


def _report_ready(unready: list[str]) -> int:
    if unready:
        print(f"not ready: {', '.join(unready)}", flush=True)
        return 1
    print("ready", flush=True)
    return 0


def _restart_when_exits(child: ChildProcess, name: str, stop: threading.Event,
                        failed: threading.Event, stopped: threading.Event) -> None:
    """The front door or the gate exiting on its own (killed, crashed) is started again on its port, as a dead
    stub's server is, while tritonserver and the other child serve on: its clients' connections fail and
    they reconnect (the front door's video jobs are lost with it). While it keeps exiting within a minute
    of its start, each restart waits the supervisor's backoff (1, 2, 4, ... 30 s). One that cannot start
    again ends the launcher (exit code 1). The thread outlives what it started (die_with_parent): it ends once
    `stopped` says the launcher stopped its children."""
    try:
        _restart_until_stop(child, name, stop, failed, Backoff())
    finally:
        stopped.wait()


def _restart_until_stop(child: ChildProcess, name: str, stop: threading.Event,
                        failed: threading.Event, backoff: Backoff) -> None:
    backoff.up()
    while not stop.wait(0.5):
        if child.process.poll() is None:
            continue
        print(f"launcher: {name} exited (code {child.process.returncode}); restarting it", flush=True)
        if stop.wait(max(1.0, backoff.failed())):  # a whole-tree stop signals it too: not a death
            return
        try:
            child.start()
        except TritonServerError as exc:
            print(f"launcher: {name} did not start again: {exc}", file=sys.stderr, flush=True)
            failed.set()
            stop.set()
            return
        backoff.up()
        print(f"launcher: {name} restarted ({child.url})", flush=True)


if __name__ == "__main__":
    sys.exit(serve())
