"""Limits before work, through `make serve`'s launcher: the gRPC gate in front of tritonserver's gRPC port,
tritonserver's HTTP port on loopback, and the priority key handed over by environment only.

The served tests use the session's `secured` launcher (tests/serving/conftest.py) and leave it serving;
the address choice is checked on the command line the launcher builds, without starting a server.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from engine_lib.serving import serve
from engine_lib.serving.grpc_gate import DEFAULT_MAX_MESSAGE_BYTES
from tests.helpers.launched import ADMIN_KEY, MODEL, PRIORITY_KEY, command_lines, rss_bytes
from tests.helpers.streaming import RequestStream, metric, run_request, scrape, wait_for_metric

# -- the gate, served ------------------------------------------------------------------------------


def _processes(secured) -> dict[str, int]:
    """tritonserver's, the gate's and the front door's pids in the `secured` stack (by their command lines)."""
    found = {}
    for pid, argv in command_lines().items():
        if argv[0].endswith("tritonserver") and f"--model-repository={secured.repo}" in argv:
            found["tritonserver"] = pid
        elif "engine_lib.serving.grpc_gate" in argv and f"127.0.0.1:{secured.grpc}" in argv:
            found["gate"] = pid
        elif "engine_lib.serving.openai_api" in argv and str(secured.front) in argv:
            found["front door"] = pid
    return found


def test_a_64_mb_prompt_is_refused_by_the_gate_before_tritonserver_reads_it(secured):
    server = _processes(secured)["tritonserver"]
    shm_before, rss_before = secured.stub_shm_bytes(), rss_bytes(server)
    result = run_request(secured.grpc_url, prompt="x" * (64 << 20), num_inference_steps=2, height=32, width=32)
    assert result.num_final == 1 and not result.responses
    assert result.error.status() == "StatusCode.RESOURCE_EXHAUSTED", str(result.error)
    assert f"vs. {DEFAULT_MAX_MESSAGE_BYTES})" in result.error.message(), result.error.message()  # names the limit
    assert secured.stub_shm_bytes() == shm_before
    assert rss_bytes(server) - rss_before < 16 << 20, (rss_before, rss_bytes(server))
    # The gate serves on, and so does the model.
    after = run_request(secured.grpc_url, prompt="after", num_inference_steps=2, height=32, width=32)
    assert after.num_final == 1 and not after.errors


def test_a_request_streams_through_the_gate_with_its_metadata(secured):
    result = run_request(secured.grpc_url, prompt="a red bicycle", num_inference_steps=3, height=32, width=32,
                         preview_interval=1)
    assert not result.errors and result.steps() == [1, 2, 3]
    assert result.final.as_numpy("image").shape == (1, 32, 32, 3)
    # Metadata reaches tritonserver: the repository API opens with the admin key alone; its refusal comes back.
    client = grpcclient.InferenceServerClient(secured.grpc_url)
    try:
        index = client.get_model_repository_index(headers={"triton-grpc-protocol-admin-key": ADMIN_KEY}, as_json=True)
        assert MODEL in {m["name"] for m in index["models"]}
        with pytest.raises(InferenceServerException, match="triton-grpc-protocol-admin-key"):
            client.get_model_repository_index()
    finally:
        client.close()


# A client process that sends a request and, once its first response arrived, waits to be killed.
_CLIENT = """
import sys, threading, numpy as np, tritonclient.grpc as grpcclient
first = threading.Event()
client = grpcclient.InferenceServerClient(sys.argv[1])
client.start_stream(callback=lambda result, error: first.set())
inputs = []
for name, datatype, value in (("prompt", "BYTES", np.array([b"gone"], dtype=np.object_)),
                              ("num_inference_steps", "INT32", np.array([20], dtype=np.int32)),
                              ("preview_interval", "INT32", np.array([1], dtype=np.int32))):
    inputs.append(grpcclient.InferInput(name, [1], datatype))
    inputs[-1].set_data_from_numpy(value)
client.async_stream_infer("qwen_image", inputs, request_id="gone")
first.wait(60)
print("first", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("how", ["cancel", "disconnect"])
def test_a_client_that_cancels_or_goes_away_cancels_its_request_through_the_gate(secured, how):
    """Held after its first step, the request is certainly running when its client cancels (or is killed):
    the model counts it cancelled and the engine holds nothing for it, though it is still held."""
    cancelled = metric(scrape(secured.metrics_url), "diffusion_requests_total", model=MODEL, outcome="cancelled")
    secured.budget.allow(1)
    try:
        if how == "cancel":
            stream = RequestStream(secured.grpc_url).send("to-cancel", prompt="long", height=32, width=32,
                                                          num_inference_steps=20, preview_interval=1)
            assert stream.wait_first(timeout=60).steps() == [1]
            stream.cancel()
            stream.close()
        else:
            client = subprocess.Popen([sys.executable, "-c", _CLIENT, secured.grpc_url], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
            try:
                assert client.stdout.readline() == "first\n"
            finally:
                client.send_signal(signal.SIGKILL)
                client.wait(10)
        assert wait_for_metric(secured.metrics_url, "diffusion_requests_total", cancelled + 1, model=MODEL,
                               outcome="cancelled") == cancelled + 1
        assert wait_for_metric(secured.metrics_url, "diffusion_runner_states", 0.0, model=MODEL) == 0.0
    finally:
        secured.budget.release()


def test_keys_reach_the_server_and_front_door_by_environment_only(secured):
    processes = _processes(secured)
    assert set(processes) == {"tritonserver", "gate", "front door"}, processes
    pids = [*processes.values(), secured.stub()[0]]
    for pid in pids:
        assert PRIORITY_KEY not in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"), pid
    for pid in (processes["tritonserver"], processes["front door"], secured.stub()[0]):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert f"DIFFUSION_PRIORITY_KEY={PRIORITY_KEY}".encode() in environ, pid
    assert ADMIN_KEY not in Path(f"/proc/{processes['gate']}/cmdline").read_text(errors="replace")


# -- the launcher's choices, without a server ---------------------------------------------------------------


_LAUNCHER_ENV = ("TRITON_ADDRESS", "TRITON_HTTP_ADDRESS", "GRPC_PORT", "GRPC_MAX_MESSAGE_BYTES", "OPENAI_PORT",
                 "DIFFUSION_PRIORITY_KEY", "MODEL_REPOSITORY", "MODELS")  # unset for the launcher's defaults


class _Child:
    """Stands in for the gate and the front door: records how the launcher made it."""

    made: list = []

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
        self.process = SimpleNamespace(poll=lambda: None, returncode=None)
        self.url = f"child-{len(_Child.made)}"
        _Child.made.append(self)

    def start(self):
        return self

    def drain(self):
        pass

    def stop(self):
        return 0


def _serve(monkeypatch, env: dict[str, str]):
    """`serve.serve()` with a supervisor that only builds the server and reports it ready; returns the
    server and the children (gate, front door) the launcher made."""
    servers = []

    class OneServer:
        def __init__(self, make_server, stop, on_ready, **kwargs):
            self.make_server, self.stop, self.on_ready = make_server, stop, on_ready

        def run(self) -> int:
            servers.append(self.make_server(0))
            self.on_ready(servers[0])
            self.stop.set()
            return 0

    monkeypatch.setattr(serve, "Supervisor", OneServer)
    monkeypatch.setattr(serve, "GrpcGate", type("Gate", (_Child,), {}))
    monkeypatch.setattr(serve, "OpenAIFrontDoor", type("FrontDoor", (_Child,), {}))
    monkeypatch.setattr(serve.signal, "signal", lambda *args: None)  # leave pytest's handlers alone
    for name in _LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _Child.made = []
    assert serve.serve(["serve"]) == 0
    return servers[0], {type(child).__name__: child for child in _Child.made}


def _flags(command: list[str]) -> dict[str, str]:
    return dict(arg[2:].split("=", 1) for arg in command if arg.startswith("--") and "=" in arg)


def test_tritonserver_http_stays_on_loopback_when_every_other_port_listens_everywhere(monkeypatch):
    server, children = _serve(monkeypatch, {"TRITON_ADDRESS": "0.0.0.0"})
    flags = _flags(server.command(Path("/backends")))
    assert flags["http-address"] == "127.0.0.1" and flags["metrics-address"] == "0.0.0.0"
    # gRPC: the gate listens on 0.0.0.0:8001 and forwards to tritonserver's own port, on loopback.
    assert flags["grpc-address"] == "127.0.0.1" and flags["grpc-port"] != "8001"
    gate = children["Gate"]
    assert gate.args == (f"127.0.0.1:{flags['grpc-port']}", "0.0.0.0", 8001, DEFAULT_MAX_MESSAGE_BYTES)
    assert children["FrontDoor"].args == (gate.url,)  # through the gate, which drains it at the stop

    server, _ = _serve(monkeypatch, {"TRITON_ADDRESS": "0.0.0.0", "TRITON_HTTP_ADDRESS": "0.0.0.0"})
    assert _flags(server.command(Path("/backends")))["http-address"] == "0.0.0.0"  # the operator's opt-in


def test_no_gate_with_a_zero_limit(monkeypatch):
    server, children = _serve(monkeypatch, {"TRITON_ADDRESS": "0.0.0.0", "GRPC_MAX_MESSAGE_BYTES": "0"})
    flags = _flags(server.command(Path("/backends")))
    assert (flags["grpc-address"], flags["grpc-port"], flags["http-address"]) == ("0.0.0.0", "8001", "127.0.0.1")
    assert set(children) == {"FrontDoor"}


def test_the_priority_key_is_random_per_launch_and_given_by_environment(monkeypatch):
    keys = []
    for _ in range(2):
        server, children = _serve(monkeypatch, {})
        key = server.extra_env["DIFFUSION_PRIORITY_KEY"]
        assert len(key) >= 32 and children["FrontDoor"].kwargs["env"]["DIFFUSION_PRIORITY_KEY"] == key
        assert not any(key in arg for arg in server.command(Path("/backends")))
        keys.append(key)
    assert keys[0] != keys[1]
    server, children = _serve(monkeypatch, {"DIFFUSION_PRIORITY_KEY": "chosen"})
    assert server.extra_env["DIFFUSION_PRIORITY_KEY"] == "chosen"
    assert children["FrontDoor"].kwargs["env"]["DIFFUSION_PRIORITY_KEY"] == "chosen"


@pytest.mark.parametrize("value", ["-1", "16MB", str(2**31)])
def test_a_bad_limit_stops_the_launcher_before_it_starts_anything(monkeypatch, capsys, value):
    monkeypatch.setattr(serve.signal, "signal", lambda *args: None)
    for name in _LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GRPC_MAX_MESSAGE_BYTES", value)
    assert serve.serve(["serve"]) == 2
    assert f"GRPC_MAX_MESSAGE_BYTES must be 0 (no gate) or a number of bytes below 2^31, got {value!r}" in \
        capsys.readouterr().err


def test_a_gate_that_exits_is_started_again_and_one_that_cannot_start_stops_the_launcher(monkeypatch, capsys):
    """A dead gate is restarted alone (tests/serving/test_supervision.py kills a real one); when its start fails,
    the launcher stops with exit code 1, and a supervisor above it (docker, the kubelet) restarts it all."""
    class DeadGate(_Child):
        starts = 0

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.process = SimpleNamespace(poll=lambda: -9, returncode=-9)

        def start(self):
            DeadGate.starts += 1
            if DeadGate.starts > 1:
                raise serve.TritonServerError("the gRPC gate exited with code 1 on port 1")
            return self

    class WaitingServer:
        def __init__(self, make_server, stop, on_ready, **kwargs):
            self.make_server, self.stop, self.on_ready = make_server, stop, on_ready

        def run(self) -> int:
            self.on_ready(self.make_server(0))
            assert self.stop.wait(10), "the launcher did not notice"
            return 0

    monkeypatch.setattr(serve, "Supervisor", WaitingServer)
    monkeypatch.setattr(serve, "GrpcGate", DeadGate)
    monkeypatch.setattr(serve, "OpenAIFrontDoor", type("FrontDoor", (_Child,), {}))
    monkeypatch.setattr(serve.signal, "signal", lambda *args: None)
    for name in _LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    assert serve.serve(["serve"]) == 1
    captured = capsys.readouterr()
    assert "launcher: the gRPC gate exited (code -9); restarting it" in captured.out
    assert "launcher: the gRPC gate did not start again" in captured.err and DeadGate.starts == 2
    assert "stopping the gRPC gate" in captured.out


def test_a_gate_that_cannot_listen_fails_its_start(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        gate = serve.GrpcGate("127.0.0.1:1", "127.0.0.1", taken.getsockname()[1], 1 << 20,
                                 log_path=tmp_path / "gate.log")
        with pytest.raises(serve.TritonServerError, match="the gRPC gate exited with code 1") as info:
            gate.start(timeout_s=30)
    assert f"grpc gate: Failed to bind to address 127.0.0.1:{gate.port}" in str(info.value)
