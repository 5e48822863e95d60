"""Admission order through a real tritonserver (step mode, two running slots): a request of another
size joins the running batch, and a short compatible request passes an incompatible head instead of
waiting behind it. Order-based, held by the tick budget.

The server also runs GPU levers a CPU has (int8 weights, an attention backend, regional compile on dynamo's
eager backend: inductor's C++ build takes minutes per graph here; VAE tiling, its images within one tile), which
order does not depend on; the last test checks them as served: images, the weight bytes gauge, the recompilation
counter and the load log (its compile time and weight bytes)."""

from __future__ import annotations

import math
import re

from safetensors import safe_open

from engine_lib.pipelines.tiny_models import ensure_model
from tests.helpers.servers import module_server
from tests.helpers.streaming import (RequestStream, close_all, metric, run_concurrently, run_held, run_request, scrape,
                                     wait_for_metric)

LEVERS = dict(quantization="int8_weight_only", attention_backend="_native_math", compile="regional",
              compile_backend="eager", vae_tiling="true")
step_server = module_server("scheduling", step_execution="true", max_num_seqs="2", mixed_size_batching="true",
                            **LEVERS)


RECOMPILES = 2  # measured 1 after the warm-up's two waves (with a LoRA too; 3 in-process from a cold start)


def final_order(streams: list[RequestStream]) -> list[str]:
    """Request ids in the order their final responses (or errors) arrived, as timed by each stream's
    callback (polling would see a stream with many progress responses queued late)."""
    for stream in streams:
        stream.collect(settle_s=0)
    return [stream.request_id for stream in sorted(streams, key=lambda stream: stream.final_at)]


def test_a_request_of_another_size_joins_the_running_batch(step_server):
    """Qwen-Image batches different sizes in one forward: a short 64x64 request does not wait for a
    long-running 32x32 one (both run at once) and finishes first."""
    budget = step_server.budget.hold()
    streams = [RequestStream(step_server.grpc_url).send("long-32", prompt="long", height=32, width=32,
                                                        num_inference_steps=30)]
    try:
        run_held(step_server, waiting=1, ticks=1)
        assert wait_for_metric(step_server.metrics_url, "diffusion_requests_running", 1.0, model="qwen_image") == 1
        streams.append(RequestStream(step_server.grpc_url).send("short-64", prompt="short", height=64, width=64,
                                                                 num_inference_steps=2))
        run_held(step_server, waiting=1, ticks=1)
        assert wait_for_metric(step_server.metrics_url, "diffusion_requests_running", 2.0, model="qwen_image") == 2
        budget.allow(3)  # enough for "short-64" (one step left), far from enough for "long-32" (28 left)
        streams[1].collect(settle_s=0)
        assert streams[0].final_at is None, "long-32 finished within three ticks"
        budget.release()
        order = final_order(streams)
    finally:
        close_all(streams, budget)
    assert order == ["short-64", "long-32"]
    for stream in streams:
        assert not stream.result.errors and stream.result.num_final == 1, stream.result.errors
    assert streams[1].result.final.as_numpy("image").shape == (1, 64, 64, 3)


def test_a_compatible_request_passes_an_incompatible_head(step_server):
    budget = step_server.budget.hold()
    long = RequestStream(step_server.grpc_url).send("long", prompt="long", height=32, width=32,
                                                      num_inference_steps=30)
    streams = [long]
    try:
        run_held(step_server, waiting=1, ticks=1)  # "long" runs alone, then the engine holds
        assert wait_for_metric(step_server.metrics_url, "diffusion_requests_running", 1.0, model="qwen_image") == 1
        # True CFG: another step key than the running request's (sizes no longer split Qwen-Image batches).
        streams.append(RequestStream(step_server.grpc_url).send("head", prompt="head", height=32, width=32,
                                                                 num_inference_steps=10, negative_prompt="blurry",
                                                                 true_cfg_scale=4.0))
        assert wait_for_metric(step_server.metrics_url, "diffusion_requests_waiting", 1.0, model="qwen_image") == 1
        streams.append(RequestStream(step_server.grpc_url).send("short", prompt="short", height=32, width=32,
                                                                 num_inference_steps=2))
        assert wait_for_metric(step_server.metrics_url, "diffusion_requests_waiting", 2.0, model="qwen_image") == 2
        budget.allow(4)  # "short" needs two ticks beside "long"; "long" needs 29 more
        streams[2].collect(settle_s=0)
        assert streams[0].final_at is None and streams[1].final_at is None
        budget.release()  # "head" (10 steps) can start only once "long" has drained
        order = final_order(streams)
    finally:
        close_all(streams, budget)
    # FIFO would run "short" only after "head", which waits for "long" to drain.
    assert order == ["short", "long", "head"]
    for stream in streams:
        assert not stream.result.errors and stream.result.num_final == 1, stream.result.errors


def test_the_levers_serve_images_of_two_sizes_and_report_weight_bytes_and_recompiles(step_server):
    """int8 weights at most 0.35x of the checkpoint's float32 transformer (by the gauge), two sizes (one with CFG)
    sharing compiled forwards, and the load log naming the levers, the warm-up's compile time and the weight bytes.
    (A LoRA's first load traces its hooks' graphs, about 20 s here: LoRAs on compiled and on int8 transformers are
    checked in-process, tests/pipelines/test_levers.py.)"""
    url, labels = step_server.grpc_url, {"model": "qwen_image"}
    log = step_server.log_text()
    assert re.search(r"levers compile=regional compile_backend=eager quantization=int8_weight_only "
                     r"attention_backend=_native_math vae_tiling=True, compiled [1-9]\d* graph\(s\) in [\d.]+ s, \d+ "
                     r"recompilation\(s\); weight bytes: .*transformer [\d.]+ MiB", log), log[-2000:]
    before = metric(scrape(step_server.metrics_url), "diffusion_compile_recompiles_total", **labels)
    requests = [dict(prompt="a red car", height=64, width=48, num_inference_steps=3, seed=7, num_images=2),
                dict(prompt="a bowl of fruit", height=32, width=64, num_inference_steps=4, seed=8,
                     negative_prompt="blurry", true_cfg_scale=3.3)]
    results = run_concurrently(url, requests, prefix="levers")
    for request, result in zip(requests, results):
        assert not result.errors and result.num_final == 1, result.errors
        assert result.final.as_numpy("image").shape == (request.get("num_images", 1), request["height"],
                                                          request["width"], 3)
    samples = scrape(step_server.metrics_url)
    with safe_open(str(ensure_model("qwen_image", "tiny") / "transformer" / "diffusion_pytorch_model.safetensors"),
                   "pt") as weights:
        float32 = sum(math.prod(weights.get_slice(key).get_shape()) * 4 for key in weights.keys())
    served = metric(samples, "diffusion_weight_bytes", component="transformer", **labels)
    assert 0 < served <= 0.35 * float32, (served, float32)
    assert metric(samples, "diffusion_weight_bytes", component="vae", **labels) > 0
    recompiles = metric(samples, "diffusion_compile_recompiles_total", **labels) - before
    print(f"served with regional compile: {recompiles:.0f} recompilation(s) for two new sizes and CFG")
    assert 0 <= recompiles <= RECOMPILES

