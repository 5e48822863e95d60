"""`make serve`'s launcher as a hostile client finds it, each case through a real tritonserver.

One launcher process (supervisor, tritonserver, gate, front door) serves the qwen_image tiny model for the
module, with a short exit timeout (EXIT_TIMEOUT_SECS: the gate's drain is GATE_DRAIN_MARGIN_S shorter); the
tests run in file order, one stops it with SIGTERM, and the last starts its own to SIGKILL.
Requests that must still be running when a test acts are held by the engine's tick budget.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest
import tritonclient.grpc as grpcclient

from client.grpc_transport import stop_stream
from engine_lib.serving import supervisor
from engine_lib.serving.processes import free_port, proc_stat
from engine_lib.serving.serve import GATE_DRAIN_MARGIN_S, unready_ports
from engine_lib.serving.supervisor import Backoff, Supervisor, in_flight
from tests.helpers.launched import MODEL, Launcher, module_launcher, raw_post
from tests.helpers.servers import model_path, running
from tests.helpers.streaming import (RequestStream, close_all, is_final_response, make_inputs, metric, post_json,
                                     run_request, scrape, sse_events, wait_for_metric)

LABELS = {"model": MODEL}


EXIT_TIMEOUT_S = 8
DRAIN_S = EXIT_TIMEOUT_S - GATE_DRAIN_MARGIN_S
launcher = module_launcher("launcher", env={"EXIT_TIMEOUT_SECS": str(EXIT_TIMEOUT_S)})


def hold_four(launcher, steps: int = 50) -> tuple[list[RequestStream], threading.Thread, dict]:
    """Four requests held in the engine: three gRPC streams through the gate and one front door request (its
    reply lands in the dict)."""
    launcher.budget.hold()
    streams = [RequestStream(launcher.grpc_url).send(f"held-{i}", prompt="held", num_inference_steps=steps,
                                                     height=32, width=32) for i in range(3)]
    reply: dict = {}
    front = threading.Thread(target=lambda: reply.update(reply=post_json(
        f"{launcher.front_url}/v2/models/{MODEL}/generate", {"prompt": "held", "num_inference_steps": steps,
                                                             "height": 32, "width": 32}, timeout=60)))
    front.start()
    assert wait_for_metric(launcher.metrics_url, "diffusion_requests_waiting", 4.0, **LABELS) == 4.0
    return streams, front, reply


def test_ports_listen_on_loopback_only(launcher):
    assert "(address 127.0.0.1)" in launcher.log()
    listening: dict[int, set] = {}
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A":  # LISTEN; the local address in hex
                address, port = local.split(":")
                listening.setdefault(int(port, 16), set()).add(address)
    loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, ::1, ::ffff:127.0.0.1
    for port in (launcher.http, launcher.grpc, launcher.metrics, launcher.front):
        assert listening.get(port) and listening[port] <= loopback, (port, listening.get(port))


def test_readiness_asks_every_public_port(launcher):
    """The probes' readiness (`serve ready`): tritonserver ready, the gate's port and the front door's
    /health (200 only while tritonserver is ready through the gate)."""
    assert unready_ports(launcher.environ) == []
    probe = subprocess.run([sys.executable, "-m", "engine_lib.serving.serve", "ready"], capture_output=True,
                           text=True, timeout=60, env={**os.environ, **launcher.environ})
    assert (probe.returncode, probe.stdout) == (0, "ready\n"), probe
    elsewhere = {**launcher.environ, "GRPC_PORT": str(free_port())}
    assert unready_ports(elsewhere) == [f"the gRPC gate (127.0.0.1:{elsewhere['GRPC_PORT']})"]


def test_readiness_says_not_ready_while_a_models_parallel_workers_are_down():
    """tritonserver stays ready while a model's worker group is broken (a Python model cannot change that): the
    probes' readiness reads the model's diffusion_parallel_workers_down."""
    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'diffusion_parallel_workers_down{instance="hunyuan_image3_0_0",model="hunyuan_image3"} 1\n'
                             b'diffusion_parallel_workers_down{instance="qwen_image_0_0",model="qwen_image"} 0\n')

        def log_message(self, *args):
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics) as metrics:
        threading.Thread(target=metrics.serve_forever, daemon=True).start()
        unready = unready_ports({"METRICS_PORT": str(metrics.server_port), "HTTP_PORT": str(free_port()),
                                 "GRPC_MAX_MESSAGE_BYTES": "0", "OPENAI_PORT": "0"}, timeout_s=1)
        metrics.shutdown()
    assert unready[0] == "the parallel workers of hunyuan_image3_0_0" and len(unready) == 2, unready


@pytest.mark.parametrize("child", ["gate", "front door"])
def test_a_killed_gate_or_front_door_is_restarted_alone(launcher, child):
    """kill -9 of the gate or of the front door: that child alone starts again on its port (tritonserver and its
    models serve on), and readiness says not ready until its port serves again."""
    name = {"gate": "the gRPC gate", "front door": "the front door"}[child]
    before = launcher.pids()
    restarts = metric(scrape(launcher.metrics_url), "diffusion_server_restarts", **LABELS)
    os.kill(before[child], signal.SIGKILL)
    killed, probes = time.monotonic(), 0
    while unready_ports(launcher.environ):
        probes += 1
        assert time.monotonic() - killed < 60, launcher.log()[-2000:]
        time.sleep(0.1)
    # Ready again: the port serves (a request through the gate, the front door's /health).
    result = run_request(launcher.grpc_url, prompt="after", num_inference_steps=2, height=32, width=32)
    assert result.num_final == 1 and not result.errors, result.errors
    status, _ = post_json(f"{launcher.front_url}/v2/models/{MODEL}/generate",
                          {"prompt": "after", "num_inference_steps": 2, "height": 32, "width": 32})
    assert status == 200
    assert probes > 0, "readiness said ready right after the kill"
    assert f"launcher: {name} exited (code -9); restarting it" in launcher.log()
    after = launcher.pids()
    assert after["tritonserver"] == before["tritonserver"] and after[child] != before[child]
    assert metric(scrape(launcher.metrics_url), "diffusion_server_restarts", **LABELS) == restarts
    print(f"{child} serving again {time.monotonic() - killed:.1f} s after its kill ({probes} probes said not ready)")


def test_the_front_door_generate_equals_tritons_own(launcher):
    body = {"prompt": "a red bicycle", "height": 32, "width": 32, "num_inference_steps": 2, "seed": 7}
    status, own = post_json(f"{launcher.triton_url}/v2/models/{MODEL}/generate", body)
    assert status == 200, own
    status, front = post_json(f"{launcher.front_url}/v2/models/{MODEL}/generate", body)
    assert status == 200, front
    assert json.loads(front) == json.loads(own)
    status, streamed = post_json(f"{launcher.front_url}/v2/models/{MODEL}/generate_stream",
                                 {**body, "preview_interval": 1})
    events = sse_events(streamed)
    assert status == 200 and [e["step"] for e in events] == [1, 2] and events[-1]["is_final"] is True
    assert events[-1]["image"] == json.loads(own)["image"]


@pytest.mark.parametrize("body, name", [
    ({"prompt": "a", "num_inference_step": 50, "heigth": 128}, "heigth"),  # misspelled keys
    ({"prompt": "a", "height": 4294967424}, "height"),  # wraps to 128 in tritonserver's INT32 parse
    ({"prompt": "a", "height": 64.5}, "height"),  # tritonserver: HTTP 500 naming nothing
    ({"prompt": "a", "height": [[64]]}, "height"),  # tritonserver flattens it
    ({"prompt": "a", "height": "64"}, "height"),
    ({"prompt": "a", "seed": True}, "seed"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "a", "true_cfg_scale": "x"}, "true_cfg_scale"),
    ({"prompt": "a", "height": [64, 64]}, "height"),
    ({"prompt": "a", "priority": 1.5}, "priority"),
    ({"prompt": "a", "priority": "urgent"}, "priority"),
    ({"prompt": "a", "priority": 9}, "priority"),
])
@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_lax_http_inputs_get_a_400_naming_the_input(launcher, body, name, endpoint):
    status, reply = post_json(f"{launcher.front_url}/v2/models/{MODEL}/{endpoint}", body)
    assert status == 400, reply
    assert f"input '{name}'" in json.loads(reply)["error"], reply


def test_hostile_bodies_are_refused_by_the_front_door(launcher):
    nested = b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    assert raw_post(launcher.front, f"/v2/models/{MODEL}/generate_stream", nested)[0] == 400
    assert raw_post(launcher.front, f"/v2/models/{MODEL}/generate", b"x" * (2 << 20))[0] == 413
    status, reply = raw_post(launcher.front, f"/v2/models/{MODEL}/generate", json.dumps(
        {"prompt": "a", "id": "x" * 100_000}).encode())
    assert status == 400 and b"id must be a string of at most" in reply
    assert raw_post(launcher.front, "/v2/models/nope/generate", b'{"prompt": "a"}')[0] == 404
    assert "restarting tritonserver" not in launcher.log()


def test_a_body_declared_over_the_limit_gets_its_413_before_it_arrives(launcher):
    """Content-Length: 5000000 and a few bytes of it: refused after the 5 s drain, not the body's 30 s timeout."""
    with socket.create_connection(("127.0.0.1", launcher.front)) as connection:
        connection.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 5000000\r\n\r\n{\"prompt\": \"")
        connection.settimeout(10)  # a third of the body timeout
        response = http.client.HTTPResponse(connection)  # the headers and the body may come in two reads
        response.begin()
        body = response.read()
    assert response.status == 413 and b"body_too_large" in body, (response.status, body)


def test_a_body_that_crashes_tritonserver_is_survived(launcher):
    """tritonserver 2.51's JSON parser dies on 50,000 nested `[`; the supervisor brings it back."""
    before = launcher.shm_regions()
    nested = b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    try:
        raw_post(launcher.http, f"/v2/models/{MODEL}/generate_stream", nested, timeout=10)
    except (ConnectionError, http.client.HTTPException, socket.timeout):
        pass  # the server died under us
    took = launcher.wait_serving(30)
    assert "tritonserver exited unexpectedly" in launcher.log() and "(restart 1)" in launcher.log()
    assert metric(scrape(launcher.metrics_url), "diffusion_server_restarts", **LABELS) == 1
    assert not before & launcher.shm_regions(), "the dead server's shared memory is still there"
    print(f"serving again {took:.1f} s after the crash was noticed")


def test_sigterm_to_tritonserver_alone_ends_each_running_request_once_and_restarts_it(launcher):
    """An operator's SIGTERM to tritonserver itself, four requests running: tritonserver waits for them (its exit
    timeout is EXIT_TIMEOUT_SECS), the gate ends each with one final naming the shutdown after its drain, the
    models unload and tritonserver exits 0 (it crashed with 'Signal (11)' when its exit timeout ran out under
    them), and the supervisor starts it again."""
    log_size = launcher.triton_log.stat().st_size
    streams, front, reply = hold_four(launcher)
    server = launcher.pids()["tritonserver"]
    try:
        os.kill(server, signal.SIGTERM)
        results = [stream.collect(timeout=EXIT_TIMEOUT_S + 30) for stream in streams]
        front.join(EXIT_TIMEOUT_S + 30)
    finally:
        close_all(streams, launcher.budget)
    for stream, result in zip(streams, results):
        assert result.num_final == 1 and not result.responses, (stream.request_id, result.errors)
        assert f"UNAVAILABLE: [request id: {stream.request_id}] server shutting down" in str(result.error)
    status, body = reply["reply"]
    assert status == 503 and b"server shutting down" in body, (status, body)
    took = launcher.wait_serving(120)
    assert "launcher: tritonserver received signal 15 from outside the launcher; restarting" in launcher.log()
    assert "launcher: tritonserver exited with code 0 after its drain" in launcher.log()
    assert not running(server)
    triton_log = launcher.triton_log.read_bytes()[log_size:].decode(errors="replace")
    assert f"successfully unloaded '{MODEL}'" in triton_log and f"{MODEL}: stopped" in triton_log
    assert "Exiting immediately" not in triton_log and "Signal (11)" not in triton_log
    assert "grpc gate: 4 requests still running after the" in triton_log
    print(f"serving again {took:.1f} s after the finals")


def test_a_killed_stub_ends_its_requests_and_comes_back(launcher):
    launcher.budget.hold()
    grpc_stream = RequestStream(launcher.grpc_url).send("in-flight", prompt="held", num_inference_steps=50)
    http_reply: dict = {}

    def http_request():
        http_reply["reply"] = post_json(f"{launcher.front_url}/v2/models/{MODEL}/generate",
                                        {"prompt": "held", "num_inference_steps": 50}, timeout=60)

    http_thread = threading.Thread(target=http_request)
    http_thread.start()
    assert wait_for_metric(launcher.metrics_url, "diffusion_requests_waiting", 2.0, **LABELS) == 2.0
    restarts = metric(scrape(launcher.metrics_url), "diffusion_server_restarts", **LABELS)
    pid, region = launcher.stub()
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    launcher.budget.release()

    result = grpc_stream.collect(timeout=30)
    http_thread.join(timeout=30)
    ended = time.monotonic() - killed
    grpc_stream.close()
    assert result.num_final == 1 and "UNAVAILABLE" in str(result.errors[0]), result.errors
    status, body = http_reply["reply"]
    assert status == 503 and b"UNAVAILABLE" in body, (status, body)
    assert ended < 30
    assert f"the Python stub of {MODEL}_0_0 (pid {pid}) died" in launcher.log()

    # From here on, whenever readiness says ready, a request succeeds.
    deadline = killed + 90
    while time.monotonic() < deadline:
        if launcher.ready():
            result = run_request(launcher.grpc_url, prompt="after", num_inference_steps=2, height=32, width=32)
            assert result.num_final == 1 and not result.errors, result.errors
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"not ready 90 s after the kill:\n{launcher.log()[-2000:]}")
    assert metric(scrape(launcher.metrics_url), "diffusion_server_restarts", **LABELS) == restarts + 1
    assert region not in launcher.shm_regions()
    assert re.search(r"stopped [0-9.]+ s after the death was noticed \(drain [0-2]\.\d s\)", launcher.log()), \
        "the drain waited though no other model held a request"
    print(f"in-flight requests ended {ended:.1f} s after the kill; serving again {time.monotonic() - killed:.1f} s after")


def test_an_abandoned_http_stream_stops_costing_compute(launcher):
    cancelled = metric(scrape(launcher.metrics_url), "diffusion_requests_total", outcome="cancelled", **LABELS)
    launcher.budget.allow(1)  # admitted and one step run, then held: running until cancelled
    connection = http.client.HTTPConnection("127.0.0.1", launcher.front, timeout=30)
    connection.request("POST", f"/v2/models/{MODEL}/generate_stream", body=json.dumps(
        {"prompt": "abandoned", "num_inference_steps": 100, "height": 256, "width": 256}))
    assert wait_for_metric(launcher.metrics_url, "diffusion_requests_running", 1.0, **LABELS) == 1.0
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    left = time.monotonic()
    assert wait_for_metric(launcher.metrics_url, "diffusion_requests_total", cancelled + 1, timeout=5,
                           outcome="cancelled", **LABELS) == cancelled + 1
    assert wait_for_metric(launcher.metrics_url, "diffusion_requests_running", 0.0, **LABELS) == 0.0
    launcher.budget.release()
    print(f"cancelled {time.monotonic() - left:.1f} s after the client left")


def test_sigterm_with_cancelled_streams_keep_alive_connections_and_running_requests_exits_0(launcher):
    """Stops the module's launcher (SIGTERM to it alone, as `docker stop` sends it). Before: 30 requests through
    the gate, each stream cancelled (stop_stream(cancel_requests=True)) after its final, which must leave
    nothing that keeps the model from unloading; idle keep-alive connections to tritonserver and the front
    door; four running requests, released once the stop began: each ends with exactly one final."""
    for i in range(30):
        client = grpcclient.InferenceServerClient(launcher.grpc_url)
        finals: "queue.Queue" = queue.Queue()
        client.start_stream(callback=lambda result, error: finals.put((result, error)))
        try:
            client.async_stream_infer(MODEL, make_inputs(prompt=f"cancelled after its final {i}",
                                                         num_inference_steps=2, height=32, width=32))
            result, error = finals.get(timeout=60)
            assert error is None and is_final_response(result), error
        finally:
            stop_stream(client, cancel=True)
            client.close()
    keep_alive = []
    for port in (launcher.http, launcher.front):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("POST", f"/v2/models/{MODEL}/generate", body=json.dumps(
            {"prompt": "keep-alive", "num_inference_steps": 2, "height": 32, "width": 32}))
        reply = connection.getresponse()
        assert reply.status == 200 and reply.getheader("Connection", "").lower() != "close"
        reply.read()
        keep_alive.append(connection)  # open and idle
    regions = launcher.shm_regions()
    assert regions
    streams, front, reply = hold_four(launcher, steps=6)
    start = time.monotonic()
    launcher.process.send_signal(signal.SIGTERM)
    launcher.budget.release()
    results = [stream.collect(timeout=EXIT_TIMEOUT_S + 30) for stream in streams]
    front.join(EXIT_TIMEOUT_S + 30)
    close_all(streams)
    code = launcher.process.wait(timeout=60)
    took = time.monotonic() - start
    for connection in keep_alive:
        connection.close()
    for stream, result in zip(streams, results):  # each its image, or (a slow machine) the drain's UNAVAILABLE
        assert result.num_final == 1, (stream.request_id, result.errors)
        assert (not result.errors and result.final.as_numpy("image").shape == (1, 32, 32, 3)
                or "server shutting down" in str(result.error)), (stream.request_id, result.errors)
    status, body = reply["reply"]
    assert status == 200 or (status == 503 and b"server shutting down" in body), (status, body)
    triton_log = launcher.triton_log.read_text(errors="replace")
    assert code == 0, launcher.log()[-3000:]
    assert took < EXIT_TIMEOUT_S + 10
    assert f"successfully unloaded '{MODEL}'" in triton_log and f"{MODEL}: stopped" in triton_log
    assert "Exiting immediately" not in triton_log
    assert not launcher.shm_regions()
    print(f"stopped in {took:.1f} s")


def test_a_launcher_killed_with_sigkill_leaves_no_hung_stub_behind(tmp_path, request):
    """`kill -9` of the launcher while its stub hangs (stopped here with SIGSTOP, as the deadlocked stubs
    we have seen after a dead server): the server, the stub and their shared memory are gone within
    seconds (processes.start_reaper), not left holding memory forever. The stub is a small Python model's
    (GATED_MODEL, its gate open), which loads in a second where the tiny pipeline's takes ten."""
    write_gated_models(tmp_path, echo=tmp_path)
    launched = Launcher(tmp_path, model_path(request), env={"MODELS": "echo"})
    try:
        wait_for(launched.ready, 120, launched, "echo ready")
        [stub_pid] = launched.stubs()
        server_pid = int(proc_stat(stub_pid)[1])
        assert launched.shm_regions()
        os.kill(stub_pid, signal.SIGSTOP)
        os.kill(launched.process.pid, signal.SIGKILL)
        launched.process.wait(10)
        killed = time.monotonic()

        def left() -> list[str]:
            return ([f"stub {pid}" for pid in launched.stubs()] + sorted(launched.shm_regions())
                    + [f"tritonserver {server_pid}"] * running(server_pid))

        while time.monotonic() - killed < 15 and left():
            time.sleep(0.1)
        assert not left(), f"left behind by the killed launcher: {left()}"
        print(f"cleaned up {time.monotonic() - killed:.1f} s after the kill")
    finally:
        launched.budget.release()
        launched.kill()


# A small Python model whose load lasts until its gate file appears: y = x.
GATED_MODEL = """
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        deadline = time.monotonic() + 300
        while not os.path.exists({gate!r}) and time.monotonic() < deadline:
            time.sleep(0.05)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", pb_utils.get_input_tensor_by_name(r, "x").as_numpy())])
                for r in requests]
"""
GATED_CONFIG = ('backend: "python"\nmax_batch_size: 0\ninstance_group [{ kind: KIND_CPU }]\n'
               'input [{ name: "x", data_type: TYPE_FP32, dims: [1] }]\noutput [{ name: "y", data_type: TYPE_FP32, dims: [1] }]\n')


def write_gated_models(tmp: Path, **gates: Path) -> None:
    """GATED_MODEL under each name of `gates` in tmp/repository, each loading once its gate path exists."""
    for name, opens in gates.items():
        (tmp / "repository" / name / "1").mkdir(parents=True)
        (tmp / "repository" / name / "1" / "model.py").write_text(GATED_MODEL.format(gate=str(opens)))
        (tmp / "repository" / name / "config.pbtxt").write_text(GATED_CONFIG)


def wait_for(condition: Callable[[], bool], timeout_s: float, launched: Launcher, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s:\n{launched.log()[-3000:]}"
        assert launched.process.poll() is None, launched.log()[-3000:]
        time.sleep(0.05)


def test_a_stub_killed_while_another_model_loads_is_noticed(tmp_path, request):
    """tritonserver 2.51 opens its ports only once every model has loaded: echo's stub, killed while `slow` still
    loads, would leave echo saying ready and never answering. The supervisor, which watches the stubs from the
    server's start, restarts the server; once it is ready, echo answers. Two small Python models: seconds to load."""
    gate = tmp_path / "gate"
    write_gated_models(tmp_path, echo=tmp_path, slow=gate)
    launched = Launcher(tmp_path, model_path(request), env={"MODELS": "echo,slow"})
    body = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.5]}]}).encode()
    try:
        wait_for(lambda: launched.triton_log.exists() and "successfully loaded 'echo'" in
                 launched.triton_log.read_text(errors="replace"), 120, launched, "echo loaded")
        [pid] = [pid for pid, argv in launched.stubs().items() if argv[1] == str(launched.repo / "echo/1/model.py")]
        assert not launched.ready()
        os.kill(pid, signal.SIGKILL)
        # by its pid, or by its instance's log line when the stub came and went between two looks (a loaded host)
        noticed = re.compile(rf"the Python stub of echo_0_0( \(pid {pid}\))? died")
        wait_for(lambda: noticed.search(launched.log()), 10, launched, "the death noticed")
        gate.touch()
        wait_for(launched.ready, 120, launched, "ready again")
        sent = time.monotonic()
        replies = [raw_post(launched.http, "/v2/models/echo/infer", body, timeout=30) for _ in range(4)]
        assert [(status, json.loads(reply)["outputs"][0]["data"]) for status, reply in replies] == [(200, [1.5])] * 4
        assert time.monotonic() - sent < 30
        assert "(restart 1)" in launched.log() and "(restart 2)" not in launched.log()
    finally:
        launched.budget.release()
        launched.kill()


# -- the supervisor's rules with fake servers (no tritonserver) ------------------------------------------------


class FakeServer:
    """Follows a script, one step per look at its stubs: whether it is ready, its live stubs, the models and
    instances its log says loaded and started, whether a load failed or it exited. `metrics`: what its /metrics says, one text per scrape."""

    def __init__(self, steps: list[dict], stop: threading.Event, metrics_url: str = "http://127.0.0.1:1/metrics"):
        self.steps, self.stop_event, self.looks = steps, stop, 0
        self.process = SimpleNamespace(poll=lambda: self.step.get("exited"), returncode=None, pid=1000)
        self.unloaded_cleanly, self.leaked_shm, self.signals, self.stops = None, [], 0, []
        self.metrics_url = metrics_url

    step = property(lambda self: self.steps[min(self.looks, len(self.steps) - 1)])
    signalled = property(lambda self: self.step.get("signalled"))  # a signal from outside started its shutdown
    stopping_on_its_own = property(lambda self: self.signalled is not None)
    loaded_models = property(lambda self: frozenset(self.step.get("loaded", ())))
    load_failed = property(lambda self: self.step.get("failed", False))
    instances = property(lambda self: frozenset(self.step.get("instances", ())))

    def start(self, timeout_s: float, wait: bool) -> "FakeServer":
        assert not wait, "the supervisor watches the stubs while the server loads"
        return self

    def check_ready(self, timeout_s: float) -> bool:
        if self.step.get("exited") is not None:
            raise RuntimeError(f"tritonserver exited with code {self.step['exited']} before it was ready")
        return self.step.get("ready", False)

    def is_ready(self) -> bool:
        return self.step.get("ready", False)

    def is_live(self) -> bool:
        return self.step.get("live", True)

    def stub_pids(self) -> dict[int, str]:
        live = dict(self.step.get("stubs", {}))
        self.looks += 1
        if self.looks > len(self.steps) + 1:
            self.stop_event.set()  # the script played, its last step held: stop the supervisor
        return live

    def is_running(self) -> bool:
        return self.step.get("exited") is None

    def send_signal(self) -> None:
        self.signals += 1

    def stop(self, grace_s=None, drain=True):
        self.stops.append({"grace_s": grace_s, "drain": drain})

    def cleanup(self):
        pass


FAKE_POLL_S = 1e-6  # the supervisor's poll over fake servers


class RecordedStop(threading.Event):
    """The supervisor's stop event, recording each wait that is a backoff's pause (any wait but the polls)."""

    def __init__(self):
        super().__init__()
        self.pauses: list[float] = []

    def wait(self, timeout=None):
        if timeout != FAKE_POLL_S:
            self.pauses.append(timeout)
        return super().wait(timeout)


def supervise(*scripts: list[dict], metrics_url: str = "http://127.0.0.1:1/metrics", drain_s: float = 0.2,
              clock=time.monotonic, stopping: list | None = None):
    """A supervisor over fake servers following `scripts` (one per start): its exit code, its log, the servers
    made and those it reported ready. `clock`: the supervisor's; `stopping` gets the servers on_stopping saw."""
    stop = RecordedStop()
    made: list[FakeServer] = []
    ready: list[FakeServer] = []
    log: list[str] = []

    def make_server(restarts: int) -> FakeServer:
        made.append(FakeServer(scripts[restarts], stop, metrics_url))
        return made[-1]

    code = Supervisor(make_server, stop, on_ready=ready.append, log=log.append, poll_s=FAKE_POLL_S, stub_drain_s=drain_s,
                      clock=clock, on_stopping=(stopping if stopping is not None else []).append).run()
    supervise.pauses = stop.pauses
    return code, [line for line in log if "stopped" not in line and "after its drain" not in line], made, ready


@pytest.fixture
def no_backoff(monkeypatch):
    monkeypatch.setattr(supervisor, "BACKOFF_S", (0.0,))


LOADING = {"stubs": {10: "echo_0_0", 11: "slow_0_0"}, "loaded": {"echo"}}  # echo loaded, slow still loading
READY = {"ready": True, "stubs": {20: "echo_0_0", 21: "slow_0_0"}, "loaded": {"echo", "slow"}}


@pytest.mark.parametrize("reaped", [False, True], ids=["zombie", "reaped"])
def test_a_stub_killed_while_another_model_loads_restarts_the_server(no_backoff, reaped):
    """A zombie has no command line, so stub_pids leaves it out as it does a reaped stub: both are gone."""
    code, log, made, ready = supervise([{"stubs": {5: "echo"}}, LOADING, {**LOADING, "stubs": {11: "slow_0_0"}}],
                                       [READY])
    assert log == ["launcher: the Python stub of echo_0_0 (pid 10) died; restarting tritonserver (restart 1)"]
    assert made[0].signals == 0, "nothing to drain before the ports open"
    assert ready == [made[1]] and code == 0


def test_a_stub_that_came_and_went_between_two_looks_is_known_by_its_log_line(no_backoff):
    instances = {"instances": {"echo_0_0", "slow_0_0"}}
    code, log, made, ready = supervise([{"stubs": {11: "slow_0_0"}, **instances},
                                        {"stubs": {11: "slow_0_0"}, "loaded": {"echo"}, **instances}], [READY])
    assert log == ["launcher: the Python stub of echo_0_0 died; restarting tritonserver (restart 1)"]
    assert ready == [made[1]] and code == 0


def test_a_stub_of_a_model_still_loading_that_goes_is_a_failed_start(no_backoff):
    code, log, made, ready = supervise([LOADING, {**LOADING, "stubs": {10: "echo_0_0"}}, {"exited": 1}])
    assert code == 1 and len(made) == 1 and not ready
    assert log == ["launcher: tritonserver exited with code 1 before it was ready"]


def test_a_loaded_stub_that_goes_after_a_load_failed_is_a_failed_start(no_backoff):
    """tritonserver unloads the loaded models of a start whose load failed, then exits 1."""
    failing = {**LOADING, "failed": True}
    code, log, made, ready = supervise([LOADING, failing, {**failing, "stubs": {}}, {"exited": 1}])
    assert code == 1 and len(made) == 1 and not ready, log


def test_once_ready_any_stub_that_goes_is_dead(no_backoff):
    code, log, made, ready = supervise([READY, {**READY, "stubs": {20: "echo_0_0"}}], [READY])
    assert log == ["launcher: the Python stub of slow_0_0 (pid 21) died; restarting tritonserver (restart 1)"]
    assert made[0].signals == 1 and made[0].stops[0]["grace_s"] == 0
    assert ready == made and code == 0


def test_in_flight_leaves_the_dead_instance_out():
    metrics = "\n".join([
        '# HELP nv_inference_pending_request_count Instantaneous number of pending requests',
        'nv_inference_pending_request_count{model="qwen_image",version="1"} 2',
        'nv_inference_pending_request_count{model="flux",version="1"} 1',
        'diffusion_requests_running{instance="qwen_image_0_0",model="qwen_image"} 4',
        'diffusion_requests_running{instance="qwen_image_0_1",model="qwen_image"} 3',
        'diffusion_requests_waiting{instance="flux_0_0",model="flux"} 5',
        'diffusion_open_streams{instance="flux_0_0",model="flux"} 6',
        'diffusion_requests_waiting_by_priority{instance="flux_0_0",model="flux",priority="1"} 5',
    ])
    assert in_flight(metrics, "qwen_image_0_0") == 1 + 3 + 5 + 6
    assert in_flight(metrics, "flux_0_0") == 2 + 4 + 3


def test_the_drain_ends_once_the_other_models_hold_no_request(no_backoff):
    """Drained once the other models' gauges read 0 for DRAINED_FOR_S: a few scrapes (one each 0.2 s), not as
    many as `stub_drain_s` (6 s) holds."""
    dead = 'diffusion_requests_running{instance="echo_0_0",model="echo"} 2\n'
    busy = 'diffusion_requests_running{instance="slow_0_0",model="slow"} 1\n'
    scrapes: list[str] = []

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = (dead + (busy if len(scrapes) < 3 else "")).encode()
            scrapes.append(body.decode())
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics) as metrics:
        threading.Thread(target=metrics.serve_forever, daemon=True).start()
        code, log, made, ready = supervise([READY, {**READY, "stubs": {21: "slow_0_0"}}], [READY], drain_s=6,
                                           metrics_url=f"http://127.0.0.1:{metrics.server_port}/metrics")
        metrics.shutdown()
    assert log == ["launcher: the Python stub of echo_0_0 (pid 20) died; restarting tritonserver (restart 1)"]
    assert len(scrapes) >= 4 and busy in scrapes[2], "ended before the other model's request"
    assert len(scrapes) <= 12, f"the drain went on for {len(scrapes)} scrapes"


def test_a_signal_from_outside_has_the_gate_end_the_requests_and_the_server_restarts(no_backoff):
    stopping: list = []
    code, log, made, ready = supervise([READY, {**READY, "signalled": 15}], [READY], stopping=stopping)
    assert log == ["launcher: tritonserver received signal 15 from outside the launcher; restarting tritonserver "
                   "(restart 1)"]
    assert stopping == [made[0]] and made[0].stops == [{"grace_s": None, "drain": False}], "its own exit is waited for"
    assert ready == made and code == 0


class SteppingClock:
    """A clock that moves `step` seconds each time it is read."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_a_server_that_stops_answering_its_health_endpoint_is_restarted(no_backoff):
    """Asked once a second of the supervisor's clock (2 s pass per look here): restarted once HEALTH_TIMEOUT_S
    (30 s) pass unanswered, not before."""
    mute = {**READY, "live": False}
    code, log, made, ready = supervise([READY, *[mute] * 20, READY], [READY], clock=SteppingClock(1.0))
    assert len(log) == 1 and re.fullmatch(r"launcher: tritonserver \(pid \S+\) did not answer its health endpoint "
                                          r"for 3\d s; restarting tritonserver \(restart 1\)", log[0]), log
    assert made[0].stops == [{"grace_s": 0, "drain": False}] and ready == made and code == 0
    code, log, made, ready = supervise([READY, *[mute] * 12, READY], clock=SteppingClock(1.0))
    assert log == [] and len(made) == 1, "restarted before its health endpoint was unanswered for 30 s"


def test_the_backoff_grows_while_restarts_fail_quickly_and_resets_after_a_healthy_run():
    """Timing policies as shipped (BACKOFF_S, HEALTHY_AFTER_S), on a clock the test moves."""
    now = [0.0]
    backoff = Backoff(clock=lambda: now[0])
    assert [backoff.failed() for _ in range(3)] == [0.0, 1.0, 2.0]  # failed starts: growing
    backoff.up()
    now[0] += supervisor.HEALTHY_AFTER_S - 1
    assert backoff.failed() == 4.0, "a short run is no success"
    backoff.up()
    now[0] += supervisor.HEALTHY_AFTER_S
    assert backoff.failed() == 0.0, "a healthy run resets the backoff"
    assert [backoff.failed() for _ in range(2)] == [0.0, 1.0]


def test_a_healthy_server_restarts_without_a_pause_each_time_it_dies():
    """Through the supervisor, its backoff on: each server serves for HEALTHY_AFTER_S (the clock moves 100 s per
    read) before its stub dies, so no restart waits."""
    dying = {**READY, "stubs": {20: "echo_0_0"}}
    code, log, made, ready = supervise([READY, dying], [READY, dying], [READY, dying], [READY],
                                       clock=SteppingClock(100.0))
    assert len(made) == 4 and code == 0, log
    assert supervise.pauses == [0.0, 0.0, 0.0]


def test_unreadable_metrics_never_count_as_drained():
    """A dead stub's drain reads the other models' gauges; a scrape that fails says nothing, so the drain lasts
    its whole `stub_drain_s` (scrapes every 0.2 s) instead of ending after DRAINED_FOR_S."""
    scrapes: list[int] = []

    class Broken(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            scrapes.append(1)
            self.send_error(500)

        def log_message(self, *args):
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Broken) as metrics:
        threading.Thread(target=metrics.serve_forever, daemon=True).start()
        supervise([READY, {**READY, "stubs": {21: "slow_0_0"}}], [READY], drain_s=3.0,
                  metrics_url=f"http://127.0.0.1:{metrics.server_port}/metrics")
        metrics.shutdown()
    assert len(scrapes) >= 8, f"the drain ended after {len(scrapes)} failed scrapes"
