"""Streamed generation over gRPC: readiness, one request, 16 concurrent mixed requests, PNG output."""

from __future__ import annotations

import base64
import io

import numpy as np
import tritonclient.grpc as grpcclient
from PIL import Image

from .streaming import MODEL, RequestStream, run_request


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
    streams = [RequestStream(server.grpc_url).send(f"c{i}", **case) for i, case in enumerate(cases)]
    try:
        results = [stream.collect(timeout=180) for stream in streams]
    finally:
        for stream in streams:
            stream.close()
    for i, (case, result) in enumerate(zip(cases, results)):
        assert not result.errors, f"request {i}: {result.errors}"
        assert result.num_final == 1, f"request {i}: {result.num_final} final responses"
        steps = result.steps()
        assert steps == sorted(steps) and len(set(steps)) == len(steps), f"request {i}: steps {steps}"
        assert steps[-1] == case["num_inference_steps"]
        if case["preview_interval"]:  # previews only at multiples of the interval
            assert all(s % case["preview_interval"] == 0 for s in steps[:-1]), steps
        else:
            assert len(steps) == 1, f"request {i}: previews without preview_interval: {steps}"
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
