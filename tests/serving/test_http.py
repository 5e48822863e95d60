"""Triton's HTTP generate_stream (server-sent events) against the decoupled model."""

from __future__ import annotations

import base64
import io
import json

from PIL import Image

from tests.helpers.streaming import post_json, sse_events


def test_generate_stream_events_end_with_a_decodable_png(server):
    body = {"prompt": "a blue circle", "height": 48, "width": 64, "num_inference_steps": 3,
            "preview_interval": 1, "output_format": "png", "seed": 3}
    status, reply = post_json(f"http://{server.http_url}/v2/models/qwen_image/generate_stream", body)
    assert status == 200, reply
    events = sse_events(reply)
    assert [e["step"] for e in events] == [1, 2, 3]
    assert all(e["num_steps"] == 3 for e in events)
    assert [e["is_final"] for e in events] == [False, False, True]
    final = events[-1]
    image = Image.open(io.BytesIO(base64.b64decode(final["image_png"])))
    assert image.format == "PNG" and image.size == (64, 48)


def test_generate_returns_the_final_response(server):
    body = {"prompt": "non-streaming", "height": 32, "width": 32, "num_inference_steps": 2, "output_format": "png"}
    status, reply = post_json(f"http://{server.http_url}/v2/models/qwen_image/generate", body)
    assert status == 200, reply
    event = json.loads(reply)
    assert event["is_final"] is True and event["step"] == 2
    assert Image.open(io.BytesIO(base64.b64decode(event["image_png"]))).size == (32, 32)


def test_infer_endpoint_refuses_decoupled_models(server):
    """Triton's behaviour, not ours: /infer cannot answer a decoupled model (docs/serving.md)."""
    body = {"inputs": [{"name": "prompt", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}
    status, reply = post_json(f"http://{server.http_url}/v2/models/qwen_image/infer", body)
    assert status == 501 and b"decoupled" in reply
