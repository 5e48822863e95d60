"""`/v1/videos` in-process: the official SDK over FastAPI's TestClient and a fake gateway that records what
would reach Triton and which requests were cancelled (the served job on LTX-2 is in test_other_pipelines.py)."""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient

from engine_lib.serving.openai_api import app as app_module
from engine_lib.serving.openai_api.gateway import InputType, Response, TritonRequestError
from engine_lib.serving.openai_api.keys import FrontDoorKeys
from engine_lib.serving.openai_api.store import RESULT_TTL_S, SQLiteStore
from tests.helpers.fake_gateway import OneModelGateway

PNG = b"\x89PNG\r\n\x1a\nan image the front door passes on"
VIDEO_INPUTS = {"prompt": InputType("TYPE_STRING"), "height": InputType("TYPE_INT32"),
                "width": InputType("TYPE_INT32"), "num_frames": InputType("TYPE_INT32"),
                "frame_rate": InputType("TYPE_FP32"), "seed": InputType("TYPE_INT64"),
                "num_inference_steps": InputType("TYPE_INT32"), "preview_interval": InputType("TYPE_INT32"),
                "output_format": InputType("TYPE_STRING"), "image": InputType("TYPE_STRING")}
CONFIGS = {"v": (VIDEO_INPUTS, {"video", "video_mp4"}),  # an image input and a frame rate (as LTX-2 with image)
           "h": ({k: t for k, t in VIDEO_INPUTS.items() if k not in ("image", "frame_rate")}, {"video", "video_mp4"}),
           "w": ({k: t for k, t in VIDEO_INPUTS.items() if k not in ("image", "frame_rate")}, {"video", "video_mp4"}),
           "img": ({k: VIDEO_INPUTS[k] for k in ("prompt", "height", "width")}, {"image"})}
FRAME_RATES = {"v": 24.0, "h": 24.0, "w": 16.0}  # as the gateway reads them (w: a Wan model at 16 fps; img: none)
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")  # the SDK's own deprecation
HOLD = "hold"  # a request with this prompt runs its first step, then waits until it is cancelled


def sent_value(tensor):
    content = tensor._get_content()
    if tensor.datatype() == "BYTES":
        return content[4:]  # after Triton's 4-byte length
    return np.frombuffer(content, {"INT32": np.int32, "INT64": np.int64, "FP32": np.float32}[tensor.datatype()])[0]


class VideoGateway(OneModelGateway):
    """Video models `v` and `h` and an image model `img`. A request of 8k + 1 frames runs two steps and ends with
    an mp4 of `mp4:<prompt>` (HOLD: waits after its first step); others are refused as LTX-2 refuses them."""

    sent: list = []
    cancelled: list = []

    async def ready_models(self, output: str = "image") -> list[str]:
        return sorted(name for name, (_, outputs) in CONFIGS.items() if output in outputs)

    async def _config(self, model: str):
        return (*CONFIGS[model], 2, FRAME_RATES.get(model))

    async def stream(self, model, tensors, request_id, parameters=None):
        inputs = {t.name(): sent_value(t) for t in tensors}
        VideoGateway.sent.append(inputs)
        if (inputs["num_frames"] - 1) % 8:
            raise TritonRequestError(f"INVALID_ARG: [request id: {request_id}] input 'num_frames': "
                                     f"{inputs['num_frames']} must be 8k + 1")
        try:
            yield Response(step=1, num_steps=2, is_final=False, images=None)
            if inputs["prompt"] == HOLD.encode():
                await asyncio.Event().wait()
            mp4 = base64.b64encode(b"mp4:" + inputs["prompt"])
            yield Response(step=2, num_steps=2, is_final=True, images=None,
                           outputs={"video_mp4": np.array([mp4], dtype=object)})
        except asyncio.CancelledError:
            VideoGateway.cancelled.append(request_id)
            raise


def start(monkeypatch, store, keys=FrontDoorKeys()):
    monkeypatch.setattr(app_module, "TritonGateway", VideoGateway)
    VideoGateway.sent, VideoGateway.cancelled = [], []
    return TestClient(app_module.create_app("fake:1", keys, store), raise_server_exceptions=False)


@pytest.fixture
def store(tmp_path):
    store = SQLiteStore(tmp_path)
    yield store
    store.close()


@pytest.fixture
def http(monkeypatch, store):
    with start(monkeypatch, store) as test_client:
        yield test_client


def sdk(http, key="unused") -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url="http://testserver/v1", http_client=http, max_retries=0)


def finished(client, video_id):
    for _ in range(200):
        video = client.videos.retrieve(video_id)
        if video.status in ("completed", "failed"):
            return video
        time.sleep(0.01)
    raise AssertionError(f"{video_id} still {video.status}")


def test_a_job_is_created_completed_downloaded_listed_and_deleted(http):
    client = sdk(http)
    video = client.videos.create(model="v", prompt="rain", size="64x32", seconds="1",
                                 extra_body={"frame_rate": 8, "seed": 3})
    assert video.object == "video" and video.id.startswith("video_") and video.status in ("in_progress", "completed")
    assert (video.model, video.size, video.seconds, video.prompt) == ("v", "64x32", "1", "rain")
    assert VideoGateway.sent == [{"prompt": b"rain", "width": 64, "height": 32, "num_frames": 9, "frame_rate": 8.0,
                                  "seed": 3, "output_format": b"mp4", "preview_interval": 1}]
    done = finished(client, video.id)
    assert done.status == "completed" and done.progress == 100 and done.completed_at >= done.created_at
    assert done.expires_at == pytest.approx(done.completed_at + RESULT_TTL_S, abs=1)
    assert client.videos.download_content(video.id).content == b"mp4:rain"
    assert [v.id for v in client.videos.list()] == [video.id]
    assert client.videos.delete(video.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)
    assert VideoGateway.cancelled == []


def test_seconds_default_to_4_at_the_models_frame_rate_and_input_reference_is_the_image(http):
    client = sdk(http)
    client.videos.create(model="v", prompt="a kite", input_reference=("in.png", PNG, "image/png"))
    assert VideoGateway.sent[-1]["num_frames"] == 97 and VideoGateway.sent[-1]["frame_rate"] == 24.0
    assert VideoGateway.sent[-1]["image"] == PNG and "width" not in VideoGateway.sent[-1]
    reply = http.post("/v1/videos", json={"model": "h", "prompt": "json", "seconds": 4})  # JSON works too
    assert reply.status_code == 200 and reply.json()["seconds"] == "4" and reply.json()["size"] == "auto"
    assert VideoGateway.sent[-1]["num_frames"] == 97 and "frame_rate" not in VideoGateway.sent[-1]
    client.videos.create(model="w", prompt="a wave", seconds="4")  # a model of its own rate, which it takes as is
    assert VideoGateway.sent[-1]["num_frames"] == 65 and "frame_rate" not in VideoGateway.sent[-1]


def test_deleting_a_running_job_cancels_its_request_and_its_content_is_a_409_until_then(http):
    client = sdk(http)
    video = client.videos.create(model="v", prompt=HOLD, seconds="1", extra_body={"frame_rate": 8})
    assert video.status == "in_progress" and video.progress == 50
    with pytest.raises(openai.APIStatusError) as info:
        client.videos.download_content(video.id)
    assert info.value.status_code == 409 and "in_progress" in info.value.message
    assert client.videos.delete(video.id).deleted
    assert VideoGateway.cancelled == [video.id]
    with pytest.raises(openai.NotFoundError):
        client.videos.download_content(video.id)


def test_shutdown_cancels_the_running_jobs_which_fail_as_restarted(monkeypatch, store):
    with start(monkeypatch, store) as http:
        video = sdk(http).videos.create(model="v", prompt=HOLD, seconds="1", extra_body={"frame_rate": 8})
    assert VideoGateway.cancelled == [video.id]
    job = store.job("", video.id)
    assert job.status == "failed" and job.error["message"] == "server restarted"


def test_one_key_can_neither_read_nor_delete_anothers_job(monkeypatch, store):
    with start(monkeypatch, store, FrontDoorKeys(api_key="alice", priority_keys={"bob": 1})) as http:
        alice, bob = sdk(http, "alice"), sdk(http, "bob")
        video = alice.videos.create(model="v", prompt=HOLD, seconds="1", extra_body={"frame_rate": 8})
        for call in (bob.videos.retrieve, bob.videos.download_content, bob.videos.delete):
            with pytest.raises(openai.NotFoundError):
                call(video.id)
        assert list(bob.videos.list()) == [] and VideoGateway.cancelled == []
        assert alice.videos.retrieve(video.id).status == "in_progress"
        assert [v.id for v in alice.videos.list()] == [video.id]


def test_jobs_per_key_stored_bytes_and_expiry_are_capped(monkeypatch, tmp_path):
    """A key's own jobs count against its cap; a store at DIFFUSION_DATA_MAX_BYTES (after expiry) refuses new jobs
    with 507; an expired job is gone with its file."""
    now = [1000.0]
    store = SQLiteStore(tmp_path, max_bytes=2 * len(b"mp4:a"), result_ttl_s=60, clock=lambda: now[0])
    with start(monkeypatch, store, FrontDoorKeys(api_key="alice", priority_keys={"bob": 1})) as http:
        http.app.state.videos.max_jobs_per_caller = 3
        client, bob = sdk(http, "alice"), sdk(http, "bob")
        held = [client.videos.create(model="v", prompt=HOLD, seconds="1", extra_body={"frame_rate": 8})
                for _ in range(3)]
        with pytest.raises(openai.RateLimitError) as info:
            client.videos.create(model="v", prompt="a", seconds="1", extra_body={"frame_rate": 8})
        assert info.value.code == "too_many_jobs"
        assert finished(bob, bob.videos.create(model="v", prompt="b", seconds="1",  # alice's jobs are not bob's
                                               extra_body={"frame_rate": 8}).id).status == "completed"
        assert [v.id for v in client.videos.list(limit=2)] == [v.id for v in held[::-1]]  # two pages, newest first
        assert [v.id for v in client.videos.list(order="asc")] == [v.id for v in held]
        for video in held:
            client.videos.delete(video.id)
        done = finished(client, client.videos.create(model="v", prompt="a", seconds="1",
                                                     extra_body={"frame_rate": 8}).id)
        assert store.used_bytes() == 2 * len(b"mp4:a") and len(list((tmp_path / "artifacts").iterdir())) == 2
        with pytest.raises(openai.APIStatusError) as info:  # full: nothing has expired yet
            client.videos.create(model="v", prompt="c", seconds="1", extra_body={"frame_rate": 8})
        assert info.value.status_code == 507 and "DIFFUSION_DATA_MAX_BYTES" in info.value.message
        assert client.videos.download_content(done.id).content == b"mp4:a"
        now[0] += 61
        assert list(client.videos.list()) == [] and list((tmp_path / "artifacts").iterdir()) == []
        assert client.videos.create(model="v", prompt="c", seconds="1", extra_body={"frame_rate": 8}).id


@pytest.mark.parametrize("kwargs, param", [
    (dict(size="64"), "size"),
    (dict(seconds="four"), "seconds"),
    (dict(seconds="-4"), "seconds"),
    (dict(seconds="0.3", extra_body={"frame_rate": 8}), "seconds"),  # 2.4 frame intervals
    (dict(seconds="1", extra_body={"frame_rate": 12}), "seconds"),  # 13 frames: the model refuses them
    (dict(model="h", input_reference=("in.png", PNG)), "input_reference"),
    (dict(model="h", extra_body={"frame_rate": 8}), "frame_rate"),
    (dict(extra_body={"num_frames": 9}), "num_frames"),
    (dict(extra_body={"seed": "one"}), "seed"),
    (dict(extra_body={"unknown": 1}), "unknown"),
])
def test_a_bad_field_is_a_400_naming_it_and_keeps_no_job(http, kwargs, param):
    client = sdk(http)
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(**{"model": "v", "prompt": "x", **kwargs})
    assert info.value.param == param, info.value.body
    assert list(client.videos.list()) == []


def test_a_model_that_makes_no_video_is_a_404_and_so_is_an_unknown_job(http):
    client = sdk(http)
    with pytest.raises(openai.NotFoundError) as info:
        client.videos.create(model="img", prompt="x")
    assert info.value.param == "model" and "v, h" not in info.value.message and "h, v" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("video_0")
    assert http.post("/v1/videos", json={"prompt": "x"}).json()["error"]["param"] == "model"  # two: no default
    for query, param in (("limit=x", "limit"), ("limit=101", "limit"), ("order=up", "order"), ("after=video_0", "after")):
        reply = http.get(f"/v1/videos?{query}")
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    assert VideoGateway.sent == []


@pytest.mark.parametrize("parameters, rate", [({"pipeline": "wan"}, 16.0), ({"pipeline": "helios"}, 24.0),
                                              ({"pipeline": "ltx2", "default_frame_rate": "30"}, 30.0),
                                              ({"pipeline": "qwen_image"}, None)])
def test_the_gateway_reads_a_models_frame_rate_from_its_config(parameters, rate):
    """Its `default_frame_rate` parameter, else its pipeline's own; an image model has none."""
    from engine_lib.serving.openai_api.gateway import TritonGateway

    class Client:
        async def get_model_config(self, model, as_json):
            return {"config": {"input": [], "output": [], "parameters": {
                key: {"string_value": value} for key, value in parameters.items()}}}

    async def read() -> float:
        gateway = TritonGateway("127.0.0.1:1")  # (its client needs the running loop)
        await gateway.close()
        gateway.client = Client()
        return await gateway.video_frame_rate("m")

    assert asyncio.run(read()) == rate
