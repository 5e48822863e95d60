"""deploy/nginx/nginx.conf in front of two real tritonservers on this machine (the session's shared
server and one of this module's, both the shipped configuration): requests are spread over both,
gRPC streams (with previews) and HTTP generate_stream complete through the balancer, and a client's
cancel reaches the engine that runs the request. Order-based: both engines are held by their tick
budgets while the test looks."""

from __future__ import annotations

import getpass
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from engine_lib.serving.processes import REPO_ROOT, free_port
from tests.helpers.servers import module_server
from tests.helpers.streaming import RequestStream, close_all, metric, post_json, scrape, sse_events

RECIPE = REPO_ROOT / "deploy" / "nginx" / "nginx.conf"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


def balancer_config(recipe: str, grpc_port: int, http_port: int, servers, workdir: Path) -> str:
    """The recipe with our replicas and ports, and its files under `workdir` (no root paths)."""
    def upstream(ports) -> str:
        return "".join(f"        server 127.0.0.1:{port};\n" for port in ports)

    text = re.sub(r"(upstream triton_grpc \{\n\s*least_conn;\n)(?:\s*server [^\n]*\n)+",
                  lambda m: m.group(1) + upstream([s.grpc_port for s in servers]), recipe)
    text = re.sub(r"(upstream front_doors \{\n\s*least_conn;\n)(?:\s*server [^\n]*\n)+",
                  lambda m: m.group(1) + upstream([s.http_port for s in servers]), text)
    text = text.replace("listen 8001 http2;", f"listen 127.0.0.1:{grpc_port} http2;")
    text = text.replace("listen 9000;", f"listen 127.0.0.1:{http_port};")
    assert text.count("127.0.0.1:") == 2 * len(servers) + 2, "the recipe's upstreams or listens changed shape"
    text = text.replace("worker_processes auto;", "worker_processes 2;")
    user = f"user {getpass.getuser()};\n" if os.geteuid() == 0 else ""  # workers keep access to workdir
    paths = "".join(f"    {name}_temp_path {workdir / name};\n" for name in
                    ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    text = text.replace("http {\n", "http {\n    access_log off;\n" + paths, 1)
    return f"{user}pid {workdir / 'nginx.pid'};\nerror_log {workdir / 'error.log'} info;\n" + text


def wait_for_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nginx did not listen on {port}")


second_replica = module_server("replica1", step_execution="true", max_num_seqs="4")


@pytest.fixture(scope="module")
def replicas(server, second_replica):
    """The session's server (the shipped configuration) and a second one like it: one server start fewer."""
    return [server, second_replica]


@pytest.fixture(scope="module")
def balancer(tmp_path_factory, replicas):
    if not os.path.exists(NGINX):
        pytest.fail("nginx is not installed: `make setup` installs Debian's nginx")
    workdir = tmp_path_factory.mktemp("nginx")
    grpc_port, http_port = free_port(), free_port()
    config = workdir / "nginx.conf"
    config.write_text(balancer_config(RECIPE.read_text(), grpc_port, http_port, replicas, workdir))
    process = subprocess.Popen([NGINX, "-p", str(workdir), "-c", str(config), "-g", "daemon off;"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for_port(grpc_port)
        wait_for_port(http_port)
        yield f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def total(servers, name: str, **labels: str) -> float:
    return sum(metric(scrape(server.metrics_url), name, model="qwen_image", **labels) for server in servers)


def wait_for_total(servers, name: str, expected: float, timeout: float = 10.0, **labels: str) -> float:
    deadline = time.monotonic() + timeout
    while (value := total(servers, name, **labels)) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def hold(servers):
    return [server.budget.hold() for server in servers]


def release(budgets) -> None:
    for budget in budgets:
        budget.release()


def test_streams_are_spread_over_both_servers_and_complete_with_previews(replicas, balancer):
    grpc_url, _ = balancer
    budgets = hold(replicas)
    streams = []
    try:
        streams = [RequestStream(grpc_url).send(f"lb{i}", prompt=f"p{i}", num_inference_steps=3, preview_interval=1)
                   for i in range(4)]
        assert wait_for_total(replicas, "diffusion_requests_waiting", 4.0) == 4
        per_server = [metric(scrape(server.metrics_url), "diffusion_requests_waiting") for server in replicas]
        assert per_server == [2, 2]  # least_conn over streams that all stay open
        release(budgets)
        for stream in streams:
            result = stream.collect()
            assert not result.errors and result.num_final == 1, result.errors
            assert result.steps() == [1, 2, 3]  # a preview after each step, the last one final
            assert result.final.as_numpy("image").shape == (1, 64, 64, 3)
    finally:
        close_all(streams)
        release(budgets)


def test_http_generate_stream_passes_through(replicas, balancer):
    _, http_url = balancer
    status, body = post_json(f"{http_url}/v2/models/qwen_image/generate_stream",
                             {"prompt": "through nginx", "num_inference_steps": 2, "preview_interval": 1})
    assert status == 200, body[:300]
    events = sse_events(body)
    assert [event["step"] for event in events] == [1, 2]
    assert "image" in events[-1]


def test_a_client_cancel_reaches_the_engine(replicas, balancer):
    grpc_url, _ = balancer
    cancelled = total(replicas, "diffusion_requests_total", outcome="cancelled")
    budgets = hold(replicas)
    for budget in budgets:
        budget.allow(1)  # one step, then the engine waits: the request is surely mid-denoise
    stream = RequestStream(grpc_url).send("lb-cancel", prompt="long", num_inference_steps=20, preview_interval=1)
    try:
        first = stream.wait_first(timeout=60)
        assert not first.errors and first.steps() == [1]
        assert wait_for_total(replicas, "diffusion_runner_states", 1.0) == 1
        stream.cancel()
        assert wait_for_total(replicas, "diffusion_requests_total", cancelled + 1, outcome="cancelled") == cancelled + 1
        for gauge in ("diffusion_requests_running", "diffusion_runner_states", "diffusion_open_streams"):
            assert wait_for_total(replicas, gauge, 0.0) == 0, gauge
    finally:
        close_all([stream])
        release(budgets)
