"""Parallel instances served by tritonserver, on one server for the module: qwen_image with cfg_parallel=true and
sequence_parallel_size=2 (four ranks: two CFG groups of two that split each forward's tokens) and hunyuan_image3 with
tensor_parallel_size=2 and expert_parallel=true (two ranks): CPU worker processes of the model's stub (gloo).

Requests stream their previews and one final; Hunyuan's think and recaption (the text's KV cache on the ranks)
give the texts and images of one process; a cancel frees the request's state, on the driver (the runner's
states) and on every rank (`diffusion_rank_states`: the CFG ranks hold none, Hunyuan's hold the prompt's KV cache
shards); a worker killed with SIGKILL ends the request in flight with one final error and the instance restarts
its workers by itself; SIGTERM to tritonserver leaves no worker behind (the last test).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from engine_lib.hooks import hooks_environment
from engine_lib.serving.processes import REPO_ROOT, free_port, proc_stat
from engine_lib.pipelines.tiny_models import ensure_model
from tests.helpers.launched import command_lines
from tests.helpers.servers import (SERVER_PRIORITY_KEY, ProbedServer, model_path, running, set_parameter,
                                   write_repository)
from tests.helpers.streaming import (RequestStream, close_all, metric, run_concurrently, run_held, run_request, scrape,
                                     wait_for_metric)
from tests.helpers.waiting import TickBudget, wait_until

CFG = dict(negative_prompt="blurry", true_cfg_scale=4.0, height=32, width=32)  # the two forwards run on the ranks


HUNYUAN = "hunyuan_image3"
TP = {"tensor_parallel_size": "2", "expert_parallel": "true"}
RANKS = {"qwen_image": 4, HUNYUAN: 2}


@pytest.fixture(scope="module")
def parallel_server(tmp_path_factory, request):
    """start_server's server, its repository holding the Hunyuan instance too; `hunyuan_budget` holds
    that engine."""
    tmp = tmp_path_factory.mktemp("parallel")
    repo = write_repository(tmp / "repository", model_path=model_path(request), cfg_parallel="true",
                            sequence_parallel_size="2")
    hunyuan = repo / HUNYUAN
    shutil.copytree(REPO_ROOT / "model_repository" / HUNYUAN, hunyuan, ignore=shutil.ignore_patterns("__pycache__"))
    text = (hunyuan / "config.pbtxt").read_text()
    for key, value in {"model_path": str(ensure_model(HUNYUAN, "tiny")), **TP}.items():
        text = set_parameter(text, key, value)
    (hunyuan / "config.pbtxt").write_text(text)
    budgets = {name: TickBudget(tmp / f"{name}_budget") for name in ("qwen_image", HUNYUAN)}
    srv = ProbedServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                       address="127.0.0.1", log_path=tmp / "tritonserver.log",
                       env={**hooks_environment(**{name: {"tick_budget_path": str(budget.path)}
                                                   for name, budget in budgets.items()}),
                            "DIFFUSION_PRIORITY_KEY": SERVER_PRIORITY_KEY})
    srv.budget, srv.hunyuan_budget = budgets["qwen_image"], budgets[HUNYUAN]
    srv.start(timeout_s=300)
    yield srv
    srv.hunyuan_budget.release()
    srv.cleanup()


def workers(server, model: str = "qwen_image", timeout_s: float = 30.0) -> list[int]:
    """The pids of the model's stub's worker processes, lowest first: rank 0 before rank 1 ... (started in rank
    order); waits for all of them (a restart starts them anew)."""
    deadline = time.monotonic() + timeout_s
    while len(found := stub_children(server, model)) != RANKS[model] and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def stub_children(server, model: str) -> list[int]:
    """The model's stub's worker processes: multiprocessing's spawned children (its resource tracker, also a
    child, is not one)."""
    model_py = str(Path(server.model_repository) / model / "1" / "model.py")
    argv = command_lines()
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
    assert len(workers(parallel_server)) == RANKS["qwen_image"]
    result = run_request(parallel_server.grpc_url, prompt="a red cube", num_inference_steps=3, preview_interval=1,
                         **CFG)
    assert not result.errors and result.num_final == 1
    assert result.steps() == [1, 2, 3]
    assert result.final.as_numpy("image").shape == (1, 32, 32, 3)


@pytest.mark.parametrize("model, inputs, rank_states", [
    ("qwen_image", dict(preview_interval=1, **CFG), 0),  # the CFG ranks hold nothing between ticks
    (HUNYUAN, dict(height=64, width=64), 2 * 2),  # the cond and uncond prompt KV cache shards, on each rank
])
def test_a_cancel_mid_request_ends_its_stream_once_and_frees_its_state_on_every_rank(parallel_server, model, inputs,
                                                                                   rank_states):
    assert len(workers(parallel_server, model)) == RANKS[model]
    budget = parallel_server.budget if model == "qwen_image" else parallel_server.hunyuan_budget
    budget.allow(1)  # one step, then the engine waits: the request is mid-denoise when the cancel arrives
    stream = RequestStream(parallel_server.grpc_url).send("to-cancel", model=model, prompt="a long request",
                                                          num_inference_steps=20, **inputs)
    metrics = parallel_server.metrics_url
    try:
        assert wait_for_metric(metrics, "diffusion_runner_states", 1.0, model=model, timeout=60) == 1
        assert wait_for_metric(metrics, "diffusion_rank_states", rank_states, model=model) == rank_states
        stream.cancel()
        ended = stream.collect(timeout=5)
        assert ended.num_final == 1 and ended.error.status() == "StatusCode.CANCELLED"
        for gauge in ("diffusion_requests_running", "diffusion_runner_states", "diffusion_open_streams",
                      "diffusion_rank_states"):
            assert wait_for_metric(metrics, gauge, 0.0, model=model) == 0.0, gauge
    finally:
        close_all([stream], budget)


# True CFG, a LoRA at 0.6 and the first-block cache at 0.6 on two images (on the tiny model 0.3 would reuse no
# step), next to a plain request of the same size (FP32 values Triton hands over rounded: the single-process
# server gets the same).
PLAIN = dict(CFG, true_cfg_scale=2.7, width=48, prompt="fruit on a table", num_inference_steps=5, seed=9,
             output_format="raw")
COMBINED = dict(PLAIN, prompt="a red cube", lora_name="toy_a", lora_scale=0.6, cache="first_block",
                cache_threshold=0.6, num_images=2, num_inference_steps=6, seed=4)


def test_true_cfg_a_lora_and_a_step_cache_on_the_ranks_equal_the_single_process_server(parallel_server, server):
    """Solo, then in one step batch with the plain request: each image within 1 level of the single-process
    server's; the ranks' cache reused steps (counted by the driver's metric: each CFG group's ranks decide over the
    group's tokens, alike) and is freed on every rank when the request ends."""
    def reused() -> float:
        return metric(scrape(parallel_server.metrics_url), "diffusion_cache_steps_total", model="qwen_image",
                      outcome="reused")

    before = reused()
    expected = [run_request(server.grpc_url, request_id=f"one-{i}", **case) for i, case in enumerate((COMBINED, PLAIN))]
    solo = run_request(parallel_server.grpc_url, request_id="ranks-solo", **COMBINED)
    parallel_server.budget.hold()
    streams = [RequestStream(parallel_server.grpc_url).send(f"ranks-{i}", **case)
               for i, case in enumerate((COMBINED, PLAIN))]
    try:
        run_held(parallel_server, waiting=2, ticks=1)  # the first tick admits both into one forward
        parallel_server.budget.release()
        batched = [stream.collect() for stream in streams]
    finally:
        close_all(streams, parallel_server.budget)
    for result, reference in zip([solo, *batched], [expected[0], *expected]):
        assert not result.errors and not reference.errors, (result.errors, reference.errors)
        image, wanted = (r.final.as_numpy("image").astype(int) for r in (result, reference))
        assert image.shape == wanted.shape and np.abs(image - wanted).max() <= 1
    assert wait_for_metric(parallel_server.metrics_url, "diffusion_rank_states", 0.0, model="qwen_image") == 0.0
    assert wait_until(lambda: reused() > before, timeout=10)


THINKS = {  # sent together, so they share the ranks' forwards: a greedy think, a recaption sampled at 0.7 and cached
    "think": dict(prompt="the red house !", bot_task="think", max_new_tokens=12, seed=3, height=64, width=64,
                  guidance_scale=3.5, num_inference_steps=3, output_format="raw"),
    "recaption": dict(prompt="cat cube old", bot_task="recaption", max_new_tokens=10, temperature=0.7, seed=8,
                      height=48, width=80, guidance_scale=3.5, num_inference_steps=4, output_format="raw",
                      cache="first_block", cache_threshold=0.15),
}


def test_think_and_recaption_on_the_ranks_give_the_texts_and_images_of_one_process(parallel_server):
    """Through tritonserver (FP32 temperature 0.7 and thresholds): each text, streamed and final, and finish reason
    as the single-process adapter writes it in-process, each image within 1 level; every rank frees its shards."""
    from engine_lib.interface import to_uint8
    from engine_lib.pipelines.hunyuan_image3.adapter import HunyuanImage3Adapter
    from tests.helpers.parity_checks import load_tiny_adapter, run_ticks

    served = run_concurrently(parallel_server.grpc_url, list(THINKS.values()), prefix="think", model=HUNYUAN)
    single = load_tiny_adapter(HUNYUAN, HunyuanImage3Adapter)
    for (rid, inputs), result in zip(THINKS.items(), served):
        assert not result.errors and result.num_final == 1, rid
        expected, chunks, _ = run_ticks(single, {rid: (0, inputs)})
        text = result.final.as_numpy("text")[0].decode()
        streamed = "".join(r.as_numpy("text")[0].decode() for r in result.responses[:-1]
                           if r.as_numpy("text") is not None)
        assert text == expected[rid]["text"][0] and text.startswith(streamed) and len(chunks[rid]) > 1, rid
        assert len(streamed) > 0, rid
        assert result.final.as_numpy("finish_reason")[0].decode() == expected[rid]["finish_reason"][0], rid
        image = to_uint8(expected[rid]["image"][0]).astype(int)
        assert np.abs(result.final.as_numpy("image")[0].astype(int) - image).max() <= 1, rid
    assert wait_for_metric(parallel_server.metrics_url, "diffusion_rank_states", 0.0, model=HUNYUAN) == 0.0


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
    assert len(now) == RANKS["qwen_image"] and not set(now) & set(before)
    assert not [pid for pid in before if running(pid)]  # the survivors of the broken group ended too


def test_sigterm_to_tritonserver_exits_cleanly_and_leaves_no_worker(parallel_server):
    pids = workers(parallel_server) + workers(parallel_server, HUNYUAN)
    assert len(pids) == sum(RANKS.values())
    assert parallel_server.stop() == 0  # SIGTERM: every model unloads, the stub closes its workers
    assert not [pid for pid in pids if running(pid)]
    assert not stub_children(parallel_server, "qwen_image") + stub_children(parallel_server, HUNYUAN)
