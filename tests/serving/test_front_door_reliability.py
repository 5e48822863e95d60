"""The front door under big responses and clients that leave.

In-process (FastAPI's TestClient over a fake gateway): what one response may weigh, that its
JSON goes out in pieces built off the event loop (memory bounded, `/health` answered meanwhile),
and that PNG encoding leaves the loop free. Through the session's `secured` launcher: a stream
without partial images is cancelled when its client leaves.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import tracemalloc

import numpy as np
import pytest
from fastapi.testclient import TestClient

from engine_lib.serving.openai_api import app as app_module, generate as generate_module
from engine_lib.serving.openai_api.gateway import InputType, Response
from engine_lib.serving.openai_api.generate import MAX_RESPONSE_JSON_BYTES, UINT8_CHARS
from engine_lib.serving.openai_api.keys import FrontDoorKeys
from tests.helpers.fake_gateway import OneModelGateway
from tests.helpers.launched import FRONT_DOOR_KEY, MODEL
from tests.helpers.streaming import metric, scrape, wait_for_metric

INPUTS = {name: InputType(kind) for name, kind in (
    ("prompt", "TYPE_STRING"), ("height", "TYPE_INT32"), ("width", "TYPE_INT32"), ("num_frames", "TYPE_INT32"),
    ("num_images", "TYPE_INT32"), ("num_inference_steps", "TYPE_INT32"), ("output_format", "TYPE_STRING"),
    ("preview_interval", "TYPE_INT32"))}
STREAM, GENERATE = "/v2/models/m/generate_stream", "/v2/models/m/generate"
MiB = 1 << 20


def answer(step: int, num_steps: int, is_final: bool, **outputs: np.ndarray) -> Response:
    progress = {"step": np.array([step], np.int32), "num_steps": np.array([num_steps], np.int32),
                "is_final": np.array([is_final])}
    return Response(step, num_steps, is_final, outputs.get("image"), {**outputs, **progress}, "1")


class FakeGateway(OneModelGateway):
    """One ready model `m` that answers every request with `answers`; `started` counts the requests that
    reached it, `cancelled` those closed before their final response."""

    answers: list = []
    started = cancelled = 0

    async def _config(self, model: str):
        return INPUTS, {"image", "image_png", "video"}, None

    async def stream(self, model, tensors, request_id, parameters=None):
        FakeGateway.started += 1
        final_sent = False
        try:
            for response in FakeGateway.answers:
                final_sent = response.is_final
                yield response
        finally:
            FakeGateway.cancelled += not final_sent


@pytest.fixture
def door(monkeypatch):
    monkeypatch.setattr(app_module, "TritonGateway", FakeGateway)
    FakeGateway.answers, FakeGateway.started, FakeGateway.cancelled = [], 0, 0
    with TestClient(app_module.create_app("fake:1", FrontDoorKeys()), raise_server_exceptions=False) as client:
        yield client


def events(body: bytes) -> list[dict]:
    return [json.loads(line[len(b"data: "):]) for line in body.split(b"\n") if line.startswith(b"data: ")]


@pytest.mark.parametrize("path", [STREAM, GENERATE])
def test_a_raw_output_declared_over_the_cap_is_refused_before_it_runs(door, path):
    """229 frames of 512x512 (180 M values, about 1 GB of JSON) never reach the model; as mp4 they do."""
    FakeGateway.answers = [answer(1, 1, True, video=np.zeros((1, 1, 8, 8, 3), np.uint8))]
    body = {"prompt": "x", "height": 512, "width": 512, "num_frames": 229}
    reply = door.post(path, json=body)
    assert reply.status_code == 400 and FakeGateway.started == 0, reply.text
    message = reply.json()["error"]
    assert message.startswith("INVALID_ARG: input 'output_format'") and "64 MiB" in message, message
    assert "output_format=png" in message and "mp4" in message, message
    assert door.post(path, json={**body, "output_format": "mp4"}).status_code == 200
    assert FakeGateway.started == 1


def test_the_declared_size_counts_frames_and_images(door):
    """Just under the cap (h x w x frames x images x 3 values, 5 bytes each) runs; one frame more is over it."""
    FakeGateway.answers = [answer(1, 1, True)]
    frames = MAX_RESPONSE_JSON_BYTES // (64 * 64 * 3 * UINT8_CHARS * 2)
    body = {"prompt": "x", "height": 64, "width": 64, "num_frames": frames, "num_images": 2}
    assert door.post(GENERATE, json=body).status_code == 200
    assert door.post(GENERATE, json={**body, "num_images": 3}).status_code == 400
    assert door.post(GENERATE, json={**body, "num_frames": frames + 1}).status_code == 400


def test_a_response_over_the_cap_ends_its_request_naming_output_format(door):
    """Sizes the request left to the model's defaults: the per-response check refuses the response (before
    any of its JSON is built) and cancels the request; streamed, after the events already sent."""
    too_big = np.zeros(MAX_RESPONSE_JSON_BYTES // UINT8_CHARS + 1, np.uint8)
    FakeGateway.answers = [answer(1, 2, False), answer(2, 2, False, video=too_big), answer(2, 2, True)]
    sent = events(door.post(STREAM, json={"prompt": "x"}).content)
    assert [e.get("step") for e in sent] == [1, None] and FakeGateway.cancelled == 1
    assert sent[1]["error"].startswith("INVALID_ARG: input 'output_format'") and "mp4" in sent[1]["error"]
    FakeGateway.answers = [answer(1, 1, True, video=too_big)]
    reply = door.post(GENERATE, json={"prompt": "x"})
    assert reply.status_code == 400 and "output_format=png" in reply.json()["error"]


def test_the_json_comes_in_pieces_as_tritonserver_writes_it(door, monkeypatch):
    monkeypatch.setattr(generate_module, "PIECE_VALUES", 7)
    video = np.arange(2 * 3 * 4 * 3, dtype=np.uint8).reshape(1, 2, 3, 4, 3)
    png = np.array([b"iVBOR", b"\xffx"], dtype=object)
    FakeGateway.answers = [answer(1, 2, False, video=video), answer(2, 2, True, video=video, video_mp4=png)]
    expected = {"model_name": "m", "model_version": "1", "video": video.ravel().tolist(), "step": 2,
                "num_steps": 2, "is_final": True}
    assert events(door.post(STREAM, json={"prompt": "x"}).content) == [
        {**expected, "step": 1, "is_final": False}, {**expected, "video_mp4": ["iVBOR", "\ufffdx"]}]
    assert door.post(GENERATE, json={"prompt": "x"}).json() == {**expected, "video_mp4": ["iVBOR", "\ufffdx"]}


def test_health_answers_while_a_maximal_response_streams_in_bounded_memory(door):
    """A response at the cap (64 MiB of JSON) goes out while /health answers in under a second, and the
    front door allocates at most 16 MiB beyond the raw tensor for it (docs/serving.md)."""
    values = (MAX_RESPONSE_JSON_BYTES - 33) // UINT8_CHARS  # 33: step, num_steps, is_final
    video = np.random.default_rng(0).integers(0, 256, values, dtype=np.uint8)
    FakeGateway.answers = [answer(1, 1, True, video=video)]
    received, slowest, probes = [0], 0.0, 0

    def stream() -> None:
        with door.stream("POST", STREAM, json={"prompt": "x"}) as reply:
            for chunk in reply.iter_bytes():
                received[0] += len(chunk)

    tracemalloc.start()
    try:
        reader = threading.Thread(target=stream)
        reader.start()
        while reader.is_alive():
            start = time.monotonic()
            assert door.get("/health").status_code == 200
            slowest, probes = max(slowest, time.monotonic() - start), probes + 1
            time.sleep(0.02)
        reader.join()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"{received[0] / MiB:.1f} MiB streamed; /health x{probes}, slowest {slowest * 1000:.0f} ms; "
          f"peak {peak / MiB:.1f} MiB traced")
    assert received[0] > values * 3 and FakeGateway.cancelled == 0
    assert slowest < 1.0 and probes >= 3
    assert peak < 16 * MiB


def on_the_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def test_png_encoding_and_json_pieces_run_off_the_event_loop(door, monkeypatch):
    """A 1024x1024 PNG takes ~0.3 s, a piece of JSON ~10 ms: on the loop they would stall every client."""
    where = []

    def recorded(function):
        def run(*args):
            where.append((function.__name__, on_the_event_loop()))
            return function(*args)
        return run

    monkeypatch.setattr(app_module, "encode_png_base64", recorded(app_module.encode_png_base64))
    monkeypatch.setattr(generate_module, "json_values", recorded(generate_module.json_values))
    image = np.zeros((2, 8, 8, 3), np.uint8)
    FakeGateway.answers = [answer(2, 4, False, image=image), answer(4, 4, True, image=image)]
    assert door.post("/v1/images/generations", json={"prompt": "x"}).status_code == 200
    assert len(events(door.post("/v1/images/generations", json={"prompt": "x", "stream": True,
                                                               "partial_images": 1}).content)) == 4
    assert len(events(door.post(STREAM, json={"prompt": "x"}).content)) == 2
    assert door.post(GENERATE, json={"prompt": "x"}).status_code == 200
    assert {name for name, _ in where} == {"encode_png_base64", "json_values"}
    assert not any(loop for _, loop in where), where


# -- the served stack (the session's `secured` launcher) --------------------------------------------------------

def test_a_stream_without_partial_images_is_cancelled_when_its_client_leaves(secured):
    """Its only response is the last: the front door watches the client while it waits (under a second)."""
    labels = {"model": MODEL}
    cancelled = metric(scrape(secured.metrics_url), "diffusion_requests_total", outcome="cancelled", **labels)
    body = json.dumps({"prompt": "left", "size": "64x64", "stream": True, "num_inference_steps": 50}).encode()
    secured.budget.allow(1)  # admitted and one step run, then held: running until cancelled
    try:
        with socket.create_connection(("127.0.0.1", secured.front)) as sock:
            sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Authorization: Bearer " + FRONT_DOOR_KEY.encode() +
                         b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            assert wait_for_metric(secured.metrics_url, "diffusion_requests_running", 1.0, **labels) == 1.0
            sock.shutdown(socket.SHUT_RDWR)
        left = time.monotonic()
        assert wait_for_metric(secured.metrics_url, "diffusion_requests_total", cancelled + 1, timeout=5,
                               outcome="cancelled", **labels) == cancelled + 1
        took = time.monotonic() - left
        assert wait_for_metric(secured.metrics_url, "diffusion_requests_running", 0.0, **labels) == 0.0
    finally:
        secured.budget.release()
    print(f"cancelled {took:.2f} s after the client left")
    assert took < 2.0
