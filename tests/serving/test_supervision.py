"""`make serve`'s launcher as a hostile client finds it, each case through a real tritonserver.

One launcher process (supervisor, tritonserver, front door) serves the qwen_image tiny model for the
module; the tests run in file order, one stops it with SIGTERM, and the last starts its own to SIGKILL.
Requests that must still be running when a test acts are held by the engine's tick budget.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from engine_lib.serving.launcher import proc_stat

from .conftest import model_path, running
from .launched import MODEL, Launcher, raw_post, serving
from .streaming import RequestStream, metric, post_json, run_request, scrape, sse_events, wait_for_metric

LABELS = {"model": MODEL}


@pytest.fixture(scope="module")
def launcher(tmp_path_factory, request):
    with serving(tmp_path_factory.mktemp("launcher"), model_path(request)) as launched:
        yield launched


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
    assert "restart" not in launcher.log()


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
    assert metric(scrape(launcher.metrics_url), "diffusion_server_restarts", **LABELS) == 2
    assert region not in launcher.shm_regions()
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


def test_sigterm_with_open_keep_alive_connections_exits_0(launcher):
    """Stops the module's launcher."""
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
    start = time.monotonic()
    launcher.process.send_signal(signal.SIGTERM)
    code = launcher.process.wait(timeout=60)
    took = time.monotonic() - start
    for connection in keep_alive:
        connection.close()
    triton_log = launcher.triton_log.read_text(errors="replace")
    assert code == 0, launcher.log()[-3000:]
    assert f"successfully unloaded '{MODEL}'" in triton_log and f"{MODEL}: stopped" in triton_log
    assert "Exiting immediately" not in triton_log
    assert not launcher.shm_regions()
    print(f"stopped in {took:.1f} s")


def test_a_launcher_killed_with_sigkill_leaves_no_hung_stub_behind(tmp_path, request):
    """`kill -9` of the launcher while its stub hangs (stopped here with SIGSTOP, as the deadlocked stubs
    we have seen after a dead server): the server, the stub and their shared memory are gone within
    seconds (launcher.start_reaper), not left holding memory forever."""
    launched = Launcher(tmp_path, model_path(request))
    try:
        launched.wait_serving(300)
        stub_pid, _ = launched.stub()
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
