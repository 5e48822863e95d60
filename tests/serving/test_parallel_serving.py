"""A parallel instance served by tritonserver: qwen_image with cfg_parallel=true, its two ranks CPU worker processes
of the model's stub (gloo), on one server for the module.

Requests stream their previews and one final; a cancel frees the request's state (the CFG ranks hold none, the
driver's runner states are the gauge); a worker killed with SIGKILL ends the request in flight with one final error
and the instance restarts its workers by itself; SIGTERM to tritonserver leaves no worker behind (the last test).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from engine_lib.serving.launcher import proc_stat

from .conftest import model_path, running, start_server
from .streaming import RequestStream, close_all, run_request, wait_for_metric

CFG = dict(negative_prompt="blurry", true_cfg_scale=4.0, height=32, width=32)  # the two forwards run on the ranks


@pytest.fixture(scope="module")
def parallel_server(tmp_path_factory, request):
    srv = start_server(tmp_path_factory.mktemp("parallel"), model_path(request), cfg_parallel="true")
    yield srv
    srv.cleanup()


def workers(server) -> list[int]:
    """The pids of the qwen_image stub's worker processes (multiprocessing's spawned children; its resource
    tracker, also a child, is not one), lowest first: rank 0 before rank 1 (started in rank order)."""
    model_py = str(Path(server.model_repository) / "qwen_image" / "1" / "model.py")
    argv = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv[int(cmdline.parent.name)] = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
    stubs = {pid for pid, args in argv.items() if args[0].endswith("triton_python_backend_stub") and args[1:2] == [model_py]}
    children = []
    for pid, args in argv.items():
        try:
            parent = int(proc_stat(pid)[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent in stubs and any("spawn_main" in arg for arg in args) and running(pid):
            children.append(pid)
    return sorted(children)


def test_a_request_streams_its_previews_and_one_final_from_the_ranks(parallel_server):
    assert len(workers(parallel_server)) == 2
    result = run_request(parallel_server.grpc_url, prompt="a red cube", num_inference_steps=3, preview_interval=1,
                         **CFG)
    assert not result.errors and result.num_final == 1
    assert result.steps() == [1, 2, 3]
    assert result.final.as_numpy("image").shape == (1, 32, 32, 3)


def test_a_cancel_mid_request_ends_its_stream_once_and_frees_its_state(parallel_server):
    budget = parallel_server.budget
    budget.allow(1)  # one step, then the engine waits: the request is mid-denoise when the cancel arrives
    stream = RequestStream(parallel_server.grpc_url).send("to-cancel", prompt="long", num_inference_steps=20,
                                                          preview_interval=1, **CFG)
    try:
        assert not stream.wait_first(timeout=60).errors
        assert wait_for_metric(parallel_server.metrics_url, "diffusion_runner_states", 1.0, model="qwen_image") == 1
        stream.cancel()
        ended = stream.collect(timeout=5)
        assert ended.num_final == 1 and ended.error.status() == "StatusCode.CANCELLED"
        for gauge in ("diffusion_requests_running", "diffusion_runner_states", "diffusion_open_streams"):
            assert wait_for_metric(parallel_server.metrics_url, gauge, 0.0, model="qwen_image") == 0.0, gauge
    finally:
        close_all([stream], budget)


def test_a_killed_worker_ends_the_request_in_flight_and_the_model_serves_again_by_itself(parallel_server):
    budget = parallel_server.budget
    before = workers(parallel_server)
    budget.allow(1)
    stream = RequestStream(parallel_server.grpc_url).send("in-flight", prompt="long", num_inference_steps=20,
                                                          preview_interval=1, **CFG)
    try:
        assert not stream.wait_first(timeout=60).errors
        killed_at = time.monotonic()
        os.kill(before[1], signal.SIGKILL)  # rank 1
        ended = stream.collect(timeout=30)
        assert stream.final_at - killed_at < 30
        assert ended.num_final == 1 and ended.steps() == [1]
        assert f"rank 1 (pid {before[1]}) died" in ended.error.message()
    finally:
        close_all([stream], budget)
    after = run_request(parallel_server.grpc_url, prompt="after the kill", num_inference_steps=2, **CFG)
    assert not after.errors and after.num_final == 1
    now = workers(parallel_server)
    assert len(now) == 2 and not set(now) & set(before)
    assert not running(before[0])  # the survivor of the broken group ended too


def test_sigterm_to_tritonserver_exits_cleanly_and_leaves_no_worker(parallel_server):
    pids = workers(parallel_server)
    assert len(pids) == 2
    assert parallel_server.stop() == 0  # SIGTERM: every model unloads, the stub closes its workers
    assert not [pid for pid in pids if running(pid)]
