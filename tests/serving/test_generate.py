"""Streamed generation over gRPC: readiness, one request, 16 concurrent mixed requests, PNG output,
and served images equal to diffusers' own `pipe(...)` (solo bitwise, batched within 1 level)."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch
import tritonclient.grpc as grpcclient
from PIL import Image

from tests.helpers.parity_checks import assert_within_one_level
from tests.helpers.streaming import (MODEL, RequestStream, close_all, metric, run_concurrently, run_held, run_request,
                                     scrape, wait_for_metric)


def test_model_is_ready(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    assert client.is_server_ready()
    assert client.is_model_ready(MODEL)
    index = {m.name: m.state for m in client.get_model_repository_index().models}
    assert index[MODEL] == "READY"
    assert "qwen_image: loaded pipeline=qwen_image" in server.log_text()


def test_one_streamed_request_gets_exactly_one_final_image(server):
    result = run_request(server.grpc_url, request_id="one", prompt="a red square", height=48, width=32,
                         num_inference_steps=3, seed=7)
    assert not result.errors
    assert result.num_final == 1
    final = result.final
    image = final.as_numpy("image")
    assert image.dtype == np.uint8 and image.shape == (1, 48, 32, 3)
    assert final.as_numpy("step")[0] == 3 and final.as_numpy("num_steps")[0] == 3
    assert bool(final.as_numpy("is_final")[0])
    assert final.get_response().id == "one"


def test_sixteen_concurrent_requests_each_end_once_in_step_order(server):
    sizes = [(32, 32), (64, 48), (48, 64), (64, 64)]
    cases = []
    for i in range(16):
        height, width = sizes[i % 4]
        cases.append(dict(prompt=f"request {i}", height=height, width=width, num_inference_steps=2 + i % 4,
                          num_images=1 + (i % 5 == 0), preview_interval=i % 3, seed=i))
    results = run_concurrently(server.grpc_url, cases)
    for i, (case, result) in enumerate(zip(cases, results)):
        assert not result.errors, f"request {i}: {result.errors}"
        assert result.num_final == 1, f"request {i}: {result.num_final} final responses"
        steps = result.steps()
        assert steps == sorted(steps) and len(set(steps)) == len(steps), f"request {i}: steps {steps}"
        assert steps[-1] == case["num_inference_steps"]
        k, n = case["preview_interval"], case["num_inference_steps"]
        expected = [s for s in range(1, n) if k and s % k == 0] + [n]  # a preview at every multiple of k
        assert steps == expected, f"request {i}: steps {steps}, expected {expected}"
        previews = result.responses[:-1]
        assert all(r.as_numpy("image").shape == (case["num_images"], case["height"], case["width"], 3)
                   for r in previews), f"request {i}: preview shapes"
        image = result.final.as_numpy("image")
        assert image.shape == (case["num_images"], case["height"], case["width"], 3), f"request {i}"
        assert {r.get_response().id for r in result.responses} == {f"c{i}"}


def test_png_output_is_base64_png_of_the_asked_size(server):
    result = run_request(server.grpc_url, prompt="a cat", height=32, width=48, num_inference_steps=2,
                         num_images=2, output_format="png")
    assert result.num_final == 1 and not result.errors
    pngs = result.final.as_numpy("image_png")
    assert pngs.shape == (2,)
    for encoded in pngs:
        image = Image.open(io.BytesIO(base64.b64decode(encoded)))
        assert image.format == "PNG" and image.size == (48, 32) and image.mode == "RGB"


def test_same_seed_gives_the_same_image(server):
    first, second = (run_request(server.grpc_url, prompt="same", height=32, width=32, num_inference_steps=2,
                                 seed=11) for _ in range(2))
    np.testing.assert_array_equal(first.final.as_numpy("image"), second.final.as_numpy("image"))


def test_served_images_are_the_diffusers_images(server, tiny_qwen_dir):
    """One request alone is bitwise `QwenImagePipeline(...)`'s image; four at once (one step batch, different
    step counts) stay within 1 level on at most 0.1 % of values (computed here on one CPU thread, as the
    server runs)."""
    from diffusers import QwenImagePipeline

    from engine_lib.interface import to_uint8

    pipe = QwenImagePipeline.from_pretrained(str(tiny_qwen_dir), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    cases = [dict(prompt=f"a lighthouse {i}", height=32, width=48, num_inference_steps=3 + i % 2, seed=20 + i)
             for i in range(4)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = [to_uint8(pipe(c["prompt"], height=32, width=48, num_inference_steps=c["num_inference_steps"],
                                  generator=torch.Generator().manual_seed(c["seed"]), output_type="np").images)
                    for c in cases]
    finally:
        torch.set_num_threads(threads)
    solo = run_request(server.grpc_url, request_id="solo", **cases[0])
    np.testing.assert_array_equal(solo.final.as_numpy("image"), expected[0])
    results = run_concurrently(server.grpc_url, cases, prefix="b")
    for result, reference in zip(results, expected):
        assert_within_one_level(result.final.as_numpy("image"), reference)


def test_a_taylorseer_request_keeps_its_image_while_a_longer_prompt_joins_and_leaves(server, held):
    """Qwen-Image pads a step batch's text to its longest prompt. A TaylorSeer request (most steps predicted from
    the last computed ones) is joined at its third step by a request with longer prompts (both with true CFG), which
    leaves at its seventh: they share those four forwards, none failed and ran again one by one, and each image is
    within 1 level (in <= 0.1 % of values) of the same request served alone."""
    cfg = dict(height=32, width=48, true_cfg_scale=3.7)  # true CFG at one scale: it is part of the batching key
    cases = {"seer": dict(cfg, prompt="a cat", negative_prompt="blurry", num_inference_steps=9, seed=3,
                          cache="taylorseer"),
             "longer": dict(cfg, prompt="a lighthouse on a cliff above a stormy sea at dusk, in oils",
                            negative_prompt="low quality, washed out", num_inference_steps=4, seed=5)}
    before = scrape(server.metrics_url)
    held.hold()
    streams = [RequestStream(server.grpc_url).send("seer", **cases["seer"])]
    try:
        run_held(server, waiting=1, ticks=2)
        two_ticks = metric(before, "diffusion_batch_size_count", model=MODEL) + 2
        assert wait_for_metric(server.metrics_url, "diffusion_batch_size_count", two_ticks, model=MODEL) == two_ticks
        streams.append(RequestStream(server.grpc_url).send("longer", **cases["longer"]))
        run_held(server, waiting=1, ticks=0)
        held.release()
        together = {stream.request_id: stream.collect(timeout=120) for stream in streams}
    finally:
        close_all(streams, held)
    ticks = metric(before, "diffusion_batch_size_count", model=MODEL) + 9
    assert wait_for_metric(server.metrics_url, "diffusion_batch_size_count", ticks, model=MODEL) == ticks
    after = scrape(server.metrics_url)
    rows = metric(after, "diffusion_batch_size_sum", model=MODEL) - metric(before, "diffusion_batch_size_sum", model=MODEL)
    assert rows == 13, "the longer request did not share four of the TaylorSeer request's forwards"
    assert metric(after, "diffusion_batch_retries_total", model=MODEL) == \
        metric(before, "diffusion_batch_retries_total", model=MODEL), "a batch failed and ran one by one"
    for rid, case in cases.items():
        assert not together[rid].errors and together[rid].num_final == 1, (rid, together[rid].errors)
        alone = run_request(server.grpc_url, request_id=f"{rid}-alone", **case)
        assert_within_one_level(together[rid].final.as_numpy("image"), alone.final.as_numpy("image"), rid)
