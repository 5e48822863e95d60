"""The launcher: backend layout, environment, start/ready/stop, load errors in the message, bounded stop,
which models it loads (MODELS, --load-model)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from engine_lib.serving import serve
from engine_lib.serving.processes import REPO_ROOT, TritonServerError, free_port
from engine_lib.serving.serve import repository_models, select_models
from engine_lib.serving.tritonserver import DEFAULT_MODEL_REPOSITORY, TritonServer
from engine_lib.serving.wheel import find_pytriton_dist, prepare_backend_dir, server_env
from tests.helpers.servers import running, write_repository


def make_server(repo: Path, tmp_path: Path, **kwargs) -> TritonServer:
    return TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                        address="127.0.0.1", log_path=tmp_path / "server.log", **kwargs)


def test_backend_dir_holds_the_python_backend_for_this_interpreter(tmp_path):
    backend = prepare_backend_dir(tmp_path / "backends") / "python"
    assert sorted(p.name for p in backend.iterdir()) == [
        "libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py"]
    stub = backend / "triton_python_backend_stub"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    expected = find_pytriton_dist() / "python_backend_stubs" / version / "triton_python_backend_stub"
    assert stub.read_bytes() == expected.read_bytes() and os.access(stub, os.X_OK)


def test_server_env_puts_the_wheel_libs_and_this_venv_first():
    dist = find_pytriton_dist()
    env = server_env(dist, {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/lib"})
    libs = env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert str(dist.parent.parent / "nvidia_pytriton.libs") in libs and libs[-1] == "/opt/lib"
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.prefix) / "bin")
    assert str(REPO_ROOT) in env["PYTHONPATH"].split(os.pathsep)


def test_empty_repository_starts_and_stops_cleanly(tmp_path):
    (tmp_path / "repo").mkdir()
    server = make_server(tmp_path / "repo", tmp_path)
    with server:
        assert server.is_ready() and server.is_running()
    assert server.process.returncode == 0
    assert "Started GRPCInferenceService" in server.log_text()
    assert not list(Path("/dev/shm").glob(f"{server.shm_prefix}*"))


def test_free_port_never_hands_out_the_same_port_twice():
    """The kernel's free loopback ports repeat (about 7 % of 2,000 binds here); a server given one port for two
    listeners does not start."""
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)


def test_an_api_gone_before_the_log_says_why_is_an_outside_signal_not_a_failure(tmp_path):
    """A process tree signalled at once: tritonserver's API goes away (a broken pipe) a moment before the log's
    thread reads the signal line. Unloading waits for that line and the server's own clean exit, and reports
    nothing left loaded; an API that goes away with no signal logged is still reported."""
    server = TritonServer(tmp_path, http_port=free_port(), admin_key="key")  # nothing listens on its port
    server.process = subprocess.Popen(["sh", "-c", "sleep 1"])  # a server that exits cleanly on its own
    threading.Timer(0.5, lambda: setattr(server, "signalled", signal.SIGTERM)).start()  # the line, late
    assert server.unload_all(timeout_s=5.0) == []
    quiet = TritonServer(tmp_path, http_port=free_port(), admin_key="key")
    quiet.process = subprocess.Popen(["sleep", "0"])
    assert "repository API unreachable" in quiet.unload_all(timeout_s=5.0)[0]
    for each in (server, quiet):
        each.process.wait()
        each.cleanup()


def test_config_error_fails_the_load_with_the_parameter_named(tmp_path):
    repo = write_repository(tmp_path / "repo", step_execution="flase")
    server = make_server(repo, tmp_path)
    with pytest.raises(TritonServerError) as info:
        server.start(timeout_s=120)
    assert "parameter 'step_execution'" in str(info.value) and "not a boolean" in str(info.value)
    assert not server.is_running()


HANGING_MODEL = textwrap.dedent('''
    import time
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor("y", np.zeros(1, np.float32))]) for _ in requests]

        def finalize(self):
            time.sleep(600)  # a model that never finishes unloading
''')


def test_stop_is_bounded_when_the_server_hangs(tmp_path):
    model = tmp_path / "repo" / "hang"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(HANGING_MODEL)
    (model / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\ninstance_group [{ kind: KIND_CPU }]\n'
        'output [{ name: "y", data_type: TYPE_FP32, dims: [1] }]\n')
    server = make_server(tmp_path / "repo", tmp_path, exit_timeout_s=300).start(timeout_s=120)
    stub_pids = subprocess.run(["pgrep", "-g", str(server.process.pid)], capture_output=True,
                               text=True).stdout.split()
    assert len(stub_pids) >= 2  # the server and its model's stub share the process group
    start = time.monotonic()
    code = server.stop(grace_s=2.0)
    assert time.monotonic() - start < 15.0  # grace 2 s + kill; loose on a loaded machine
    assert code == -signal.SIGKILL
    assert subprocess.run(["pgrep", "-g", str(server.process.pid)], capture_output=True).returncode == 1
    server.cleanup()


def test_cli_serves_until_interrupted(tmp_path):
    """`make serve`: tritonserver and the OpenAI front door come up together and stop together."""
    (tmp_path / "repo").mkdir()
    ports = [str(free_port()) for _ in range(4)]
    env = dict(os.environ, MODEL_REPOSITORY=str(tmp_path / "repo"), HTTP_PORT=ports[0], GRPC_PORT=ports[1],
               METRICS_PORT=ports[2], OPENAI_PORT=ports[3], MODELS="all")  # the empty repository has no qwen_image
    cli = subprocess.Popen([sys.executable, "-m", "engine_lib.serving.serve", "serve", "--address", "127.0.0.1",
                            "--log-file", str(tmp_path / "cli.log")],
                           env=env, stdout=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = cli.stdout.readline()
            lines.append(line)
            if "ready" in line or not line:
                break
        assert any(f"grpc 127.0.0.1:{ports[1]}" in line for line in lines), lines
        assert any(f"front door http://127.0.0.1:{ports[3]}" in line for line in lines), lines
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[3]}/v1/models", timeout=10) as reply:
            assert json.load(reply) == {"object": "list", "data": []}  # the empty repository serves no model
        cli.send_signal(signal.SIGINT)
        assert cli.wait(timeout=30) == 0
        output = cli.stdout.read()
        assert "stopping the front door" in output and "stopped (exit code 0)" in output
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{ports[3]}/health", timeout=5)
    finally:
        if cli.poll() is None:
            cli.kill()


def test_cli_fails_when_the_openai_front_door_cannot_start(tmp_path):
    (tmp_path / "repo").mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = dict(os.environ, MODEL_REPOSITORY=str(tmp_path / "repo"), HTTP_PORT=str(free_port()),
                   GRPC_PORT=str(free_port()), METRICS_PORT=str(free_port()),
                   OPENAI_PORT=str(taken.getsockname()[1]), MODELS="all")
        cli = subprocess.run([sys.executable, "-m", "engine_lib.serving.serve", "serve", "--address",
                              "127.0.0.1", "--log-file", str(tmp_path / "cli.log")],
                             env=env, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 1
    assert "the OpenAI front door exited" in cli.stderr and "address already in use" in cli.stderr.lower(), cli.stderr
    assert "tritonserver" not in subprocess.run(["pgrep", "-f", str(tmp_path / "repo")], capture_output=True,
                                                 text=True).stdout


def test_loopback_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("TRITON_ADDRESS", raising=False)
    command = TritonServer(Path("/models")).command(Path("/backends"))
    for flag in ("http", "grpc", "metrics"):
        assert f"--{flag}-address=127.0.0.1" in command
    monkeypatch.setenv("TRITON_ADDRESS", "0.0.0.0")
    assert "--grpc-address=0.0.0.0" in TritonServer(Path("/models")).command(Path("/backends"))


def test_an_admin_key_protects_the_admin_apis_of_an_explicit_mode_server():
    server = TritonServer(Path("/models"), admin_key="k", load_models=["flux"], exit_timeout_s=120)
    command = server.command(Path("/backends"))
    restricted = "shared-memory,model-repository,statistics,trace,logging:admin-key=k"
    assert {"--model-control-mode=explicit", "--load-model=flux", f"--http-restricted-api={restricted}",
            f"--grpc-restricted-protocol={restricted}"} <= set(command)
    # The drain is the launcher's unload (up to 120 s); tritonserver's own exit timeout is as long, so that a SIGTERM
    # reaching it from outside leaves the gate's drain its time (it crashed under running requests at 3 s).
    assert "--exit-timeout-secs=120" in command
    assert "--model-control-mode=explicit" not in TritonServer(Path("/models")).command(Path("/backends"))


SHIPPED = ["bagel", "flux", "flux2", "flux_kontext", "helios", "hunyuan_image3", "ltx2", "qwen_image",
           "qwen_image_edit", "qwen_image_edit_plus", "sd3", "wan", "wan_i2v", "z_image"]


def test_the_repository_s_models_are_its_folders_with_a_config():
    assert repository_models(DEFAULT_MODEL_REPOSITORY) == SHIPPED


@pytest.mark.parametrize("value, models", [
    (None, ["qwen_image"]), ("", ["qwen_image"]), (" ", ["qwen_image"]),
    ("flux", ["flux"]), ("flux,ltx2", ["flux", "ltx2"]), ("ltx2, flux ltx2", ["ltx2", "flux"]),
    (["sd3", "bagel,helios"], ["sd3", "bagel", "helios"]),
    ("all", ["*"]), ("ALL", ["*"]), ("flux,all", ["*"]), (["*"], ["*"]),
])
def test_models_to_load_default_to_qwen_image_alone(value, models):
    assert select_models(value, DEFAULT_MODEL_REPOSITORY) == models


def test_an_unknown_model_is_refused_naming_the_known_ones():
    with pytest.raises(TritonServerError) as info:
        select_models("flux,qwen-image", DEFAULT_MODEL_REPOSITORY)
    assert f"unknown model qwen-image in {DEFAULT_MODEL_REPOSITORY};" in str(info.value)
    assert f"known: {', '.join(SHIPPED)}, or all" in str(info.value)


@pytest.mark.parametrize("argv, env, loaded", [
    ([], None, ["qwen_image"]),
    ([], "flux,ltx2", ["flux", "ltx2"]),
    ([], "all", ["*"]),
    (["--load-model=sd3", "--load-model=helios"], "flux", ["sd3", "helios"]),  # --load-model wins
    (["--load-model=all"], None, ["*"]),
])
def test_serve_loads_what_models_or_load_model_name(monkeypatch, capsys, argv, env, loaded):
    """`make serve MODELS=...`: the launcher's tritonserver command line loads exactly those models (explicit
    model control); the supervisor is replaced by one that only builds the server."""
    commands = []

    class OneServer:
        def __init__(self, make_server, stop, **kwargs):
            self.make_server = make_server

        def run(self) -> int:
            commands.append(self.make_server(0).command(Path("/backends")))
            return 0

    monkeypatch.setattr(serve, "Supervisor", OneServer)
    monkeypatch.setattr(serve.signal, "signal", lambda *args: None)  # leave pytest's handlers alone
    monkeypatch.delenv("MODEL_REPOSITORY", raising=False)
    monkeypatch.delenv("TRITON_ADDRESS", raising=False)
    if env is None:
        monkeypatch.delenv("MODELS", raising=False)
    else:
        monkeypatch.setenv("MODELS", env)
    assert serve.serve(["serve", "--openai-port=0", *argv]) == 0
    [command] = commands
    assert "--model-control-mode=explicit" in command
    assert [a.split("=", 1)[1] for a in command if a.startswith("--load-model=")] == loaded
    shown = "every model" if loaded == ["*"] else ", ".join(loaded)
    assert f"(address 127.0.0.1), loading {shown}\n" in capsys.readouterr().out


def test_serve_refuses_an_unknown_model_before_starting_anything(tmp_path):
    env = dict(os.environ, MODELS="qwen_image,fluxx", TRITON_ADDRESS="127.0.0.1")
    env.pop("MODEL_REPOSITORY", None)
    cli = subprocess.run([sys.executable, "-m", "engine_lib.serving.serve", "serve"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 2
    assert "unknown model fluxx" in cli.stderr and f"known: {', '.join(SHIPPED)}, or all" in cli.stderr, cli.stderr
    assert "starting tritonserver" not in cli.stdout


@pytest.mark.parametrize("forks", [False, True], ids=["alone", "after-a-fork"])
def test_a_reaper_ends_its_group_when_its_owner_is_killed(tmp_path, forks):
    """The owner of a reaper (start_reaper) is SIGKILLed: its group (here a `sleep` in its own session) and
    its shared memory are gone within seconds, also when the owner had forked a child that lives on (the
    child must not hold the reaper's pipe, or the reaper would wait for it too)."""
    prefix = f"reaper-test-{os.getpid()}-{forks}-"
    script = textwrap.dedent(f"""
        import os, signal, subprocess, time
        from engine_lib.serving.processes import start_reaper
        group = subprocess.Popen(["sleep", "60"], start_new_session=True, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        open("/dev/shm/{prefix}region", "w").close()
        start_reaper(group.pid, "{prefix}")
        child = os.fork() if {forks} else 1
        if child == 0:  # lets go of our stdout and stderr (the test reads them to EOF), keeps the rest
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            time.sleep(60)
            os._exit(0)
        print(group.pid, child, flush=True)
        time.sleep(0.5)  # the reaper has started reading
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    owner = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert owner.returncode == -signal.SIGKILL, owner.stderr
    group, child = map(int, owner.stdout.split())
    try:
        killed = time.monotonic()
        while time.monotonic() - killed < 10 and (running(group) or (Path("/dev/shm") / f"{prefix}region").exists()):
            time.sleep(0.1)
        assert not running(group), "the reaper did not end the group"
        assert not (Path("/dev/shm") / f"{prefix}region").exists(), "the reaper did not remove the shm region"
    finally:
        for pid in (group, child):
            if pid > 1 and running(pid):
                os.kill(pid, signal.SIGKILL)
