"""The OpenAI Images API front door, driven by the official `openai` SDK, against a real tritonserver.

One tritonserver (one running request and one waiting at most, so a third is over its queue)
and front doors started by the launcher's `OpenAIFrontDoor`: one open, one with a bearer
key, one pointing at a port where no Triton listens. Requests that must still be running
when the test acts are held by the engine's tick budget.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from typing import Optional

import numpy as np
import openai
import pytest

from engine_lib.serving.processes import OpenAIFrontDoor, free_port
from tests.helpers.front_door import decode, front_door, sdk
from tests.helpers.servers import module_server
from tests.helpers.streaming import RequestStream, close_all, metric, run_held, run_request, scrape, wait_for_metric

MODEL = "qwen_image"


triton = module_server("openai", step_execution="true", max_num_seqs="1", max_queue="1")


@pytest.fixture(scope="module")
def door(triton, tmp_path_factory):
    fd = front_door(triton.grpc_url, tmp_path_factory.mktemp("door"), OPENAI_API_KEY="")
    yield fd
    assert fd.stop() in (0, -signal.SIGTERM), fd.log_tail()  # uvicorn re-raises the SIGTERM it handled


def test_models_lists_the_ready_triton_models(door):
    assert [m.id for m in sdk(door).models.list()] == [MODEL]


def test_generate_returns_the_png_of_the_triton_grpc_image(door, triton):
    result = sdk(door).images.generate(model=MODEL, prompt="a red lighthouse", size="48x32", n=2,
                                       response_format="b64_json", extra_body={"seed": 7, "num_inference_steps": 3})
    assert result.size == "48x32" and len(result.data) == 2
    expected = run_request(triton.grpc_url, prompt="a red lighthouse", width=48, height=32, num_images=2, seed=7,
                           num_inference_steps=3).final.as_numpy("image")
    for image, want in zip(result.data, expected):
        np.testing.assert_array_equal(decode(image.b64_json), want)


def test_streaming_yields_partial_images_then_the_completed_image(door, triton):
    events = list(sdk(door).images.generate(model=MODEL, prompt="a blue boat", size="32x32", stream=True,
                                            partial_images=2, extra_body={"seed": 5, "num_inference_steps": 6}))
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    assert all(decode(e.b64_json).shape == (32, 32, 3) for e in events)
    expected = run_request(triton.grpc_url, prompt="a blue boat", width=32, height=32, seed=5,
                           num_inference_steps=6).final.as_numpy("image")[0]
    np.testing.assert_array_equal(decode(events[-1].b64_json), expected)


@pytest.mark.parametrize("kwargs, param", [
    (dict(size="64"), "size"),
    (dict(size="65x64"), "size"),  # the model's own check: a multiple of its size multiple
    (dict(n=0), "n"),
    (dict(response_format="file"), "response_format"),
    (dict(response_format="url", stream=True), "response_format"),
    (dict(response_format="url", extra_body={"url_ttl": 0}), "url_ttl"),
    (dict(response_format="url", extra_body={"url_ttl": 7 * 24 * 3600 + 1}), "url_ttl"),
    (dict(extra_body={"url_ttl": 60}), "url_ttl"),  # only with url
    (dict(output_format="jpeg"), "output_format"),
    (dict(quality="high"), "quality"),
    (dict(extra_body={"strength": 0.5}), "strength"),
    (dict(extra_body={"num_inference_steps": 2.5}), "num_inference_steps"),
    (dict(extra_body={"num_inference_steps": 2**40}), "num_inference_steps"),
    (dict(extra_body={"seed": -1}), "seed"),
])
def test_bad_input_is_a_400_naming_the_field(door, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        sdk(door).images.generate(model=MODEL, prompt="x", **kwargs)
    assert info.value.param == param, info.value.body
    assert param in info.value.message or param == "size"


@pytest.mark.parametrize("body, status", [
    (b"not json", 400),
    (b"[" * 50_000, 400),  # nesting that crashes tritonserver's own JSON parser (docs/serving.md)
    (b'["a", "list"]', 400),
    (b'{"model": "qwen_image", "prompt": "' + b"x" * (2 << 20) + b'"}', 413),
    (b'{"model": "qwen_image", "prompt": ["nested"]}', 400),
    (b'{"model": "qwen_image", "prompt": "x", "seed": {"a": [1]}}', 400),
])
def test_hostile_bodies_get_an_error_and_the_front_door_keeps_serving(door, body, status):
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{door.url}/v1/images/generations", data=body,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    assert info.value.code == status
    assert set(json.load(info.value)["error"]) == {"message", "type", "param", "code"}
    assert [m.id for m in sdk(door).models.list()] == [MODEL]


def test_unknown_model_is_a_404(door):
    with pytest.raises(openai.NotFoundError) as info:
        sdk(door).images.generate(model="dall-e-3", prompt="x")
    assert info.value.code == "model_not_found" and info.value.param == "model"


def test_a_full_queue_is_a_429(door, triton):
    """max_num_seqs 1 and max_queue 1: one request runs (held), one waits, the next is refused."""
    triton.budget.hold()
    streams = [RequestStream(triton.grpc_url).send("running", prompt="queued", height=32, width=32,
                                                   num_inference_steps=2, preview_interval=1)]
    try:
        run_held(triton, waiting=1, ticks=1)  # it is admitted and runs one step, then the engine holds it
        streams[0].wait_first(timeout=60)
        streams.append(RequestStream(triton.grpc_url).send("waiting", prompt="queued", height=32, width=32,
                                                           num_inference_steps=2))
        run_held(triton, waiting=1, ticks=0)  # the queue (max_queue 1) is full
        with pytest.raises(openai.RateLimitError) as info:
            sdk(door).images.generate(model=MODEL, prompt="one too many", size="32x32")
        assert "queue full" in info.value.message
    finally:
        close_all(streams, triton.budget)


def test_leaving_a_stream_cancels_the_triton_request(door, triton):
    cancelled = metric(scrape(triton.metrics_url), "diffusion_requests_total", model=MODEL, outcome="cancelled")
    triton.budget.allow(1)  # one step (a partial image at step 1 of 4), then the engine holds the request
    try:
        stream = sdk(door).images.generate(model=MODEL, prompt="left behind", size="32x32", stream=True,
                                           partial_images=3, extra_body={"num_inference_steps": 4})
        first = next(iter(stream))
        assert first.type == "image_generation.partial_image" and first.partial_image_index == 0
        stream.close()
        assert wait_for_metric(triton.metrics_url, "diffusion_requests_total", cancelled + 1, model=MODEL,
                               outcome="cancelled") == cancelled + 1
        assert wait_for_metric(triton.metrics_url, "diffusion_runner_states", 0.0, model=MODEL) == 0.0
    finally:
        triton.budget.release()


def test_a_client_gone_before_the_image_cancels_the_triton_request(door, triton):
    """Not streamed: the front door notices the closed connection while it waits for the final response."""
    cancelled = metric(scrape(triton.metrics_url), "diffusion_requests_total", model=MODEL, outcome="cancelled")
    triton.budget.hold()
    try:
        body = json.dumps({"model": MODEL, "prompt": "never seen", "size": "32x32"}).encode()
        host, port = door.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            run_held(triton, waiting=1, ticks=0)  # the request waits in the held engine
        assert wait_for_metric(triton.metrics_url, "diffusion_requests_total", cancelled + 1, model=MODEL,
                               outcome="cancelled") == cancelled + 1
    finally:
        triton.budget.release()


def fetch(url: str, api_key: Optional[str]) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_a_bearer_key_is_required_when_set_and_url_images_are_behind_it(triton, tmp_path):
    """response_format "url": each image is a file under OPENAI_PUBLIC_URL holding the PNG the same request gets
    inline, for the key that made it, until its url_ttl; a wrong or expired id is a 404, no key a 401."""
    port = free_port()
    public = f"http://localhost:{port}"  # another name of the door's address: the URLs are built from it
    keyed = OpenAIFrontDoor(triton.grpc_url, port=port, log_path=tmp_path / "openai.log",
                            env={**os.environ, "OPENAI_API_KEY": "s3cret", "OPENAI_PUBLIC_URL": public + "/"}).start()
    try:
        with pytest.raises(openai.AuthenticationError):
            sdk(keyed, api_key="wrong").models.list()
        client = sdk(keyed, api_key="s3cret")
        assert [m.id for m in client.models.list()] == [MODEL]
        ask = dict(model=MODEL, prompt="a green hill", size="48x32", n=2,
                   extra_body={"seed": 11, "num_inference_steps": 2, "true_cfg_scale": 1.3})
        by_url = client.images.generate(response_format="url", **ask)
        inline = client.images.generate(response_format="b64_json", **ask)
        assert len(by_url.data) == 2 and by_url.data[0].url != by_url.data[1].url
        for image, want in zip(by_url.data, inline.data):
            assert re.fullmatch(rf"{public}/v1/files/file_[0-9a-f]{{32}}/content", image.url), image.url
            status, png = fetch(image.url, "s3cret")
            assert status == 200 and png == base64.b64decode(want.b64_json)
        url = by_url.data[0].url
        assert fetch(url, None)[0] == 401 and fetch(url, "wrong")[0] == 401
        assert fetch(re.sub("file_[0-9a-f]+", "file_" + "0" * 32, url), "s3cret")[0] == 404
        short = client.images.generate(response_format="url", model=MODEL, prompt="x", size="32x32",
                                       extra_body={"url_ttl": 1, "num_inference_steps": 2}).data[0].url
        time.sleep(1.2)
        assert fetch(short, "s3cret")[0] == 404 and fetch(url, "s3cret")[0] == 200
    finally:
        keyed.stop()


def test_triton_not_there_is_a_503(tmp_path):
    orphan = front_door(f"127.0.0.1:{free_port()}", tmp_path)
    try:
        with pytest.raises(openai.InternalServerError) as info:
            sdk(orphan).images.generate(model=MODEL, prompt="x")
        assert info.value.status_code == 503 and "not ready" in info.value.message
    finally:
        orphan.stop()


def test_a_front_door_that_cannot_start_fails_with_its_output(triton, tmp_path):
    from engine_lib.serving.processes import TritonServerError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        door = OpenAIFrontDoor(triton.grpc_url, port=taken.getsockname()[1], log_path=tmp_path / "o.log")
        started = time.monotonic()
        with pytest.raises(TritonServerError, match="OpenAI front door exited"):
            door.start(timeout_s=60)
        assert time.monotonic() - started < 60


def test_the_front_door_imports_no_model_code():
    import subprocess

    code = ("import sys, engine_lib.serving.openai_api.app, engine_lib.serving.openai_api.__main__; "
            "sys.exit(3 if 'torch' in sys.modules or 'diffusers' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
