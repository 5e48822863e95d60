"""`/v1/images/edits` in-process: the official SDK over FastAPI's TestClient and a fake gateway that records
what would reach Triton (the served edit, bitwise against gRPC, is in test_other_pipelines.py)."""

from __future__ import annotations

import io
import struct

import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient

from engine_lib.images import MAX_IMAGE_BYTES, decode_image
from engine_lib.request import InvalidInputError
from engine_lib.serving.openai_api import app as app_module
from engine_lib.serving.openai_api.gateway import InputType, Response, TritonRequestError
from tests.helpers.fake_gateway import HOSTILE_VALUES, OneModelGateway
from tests.helpers.hostile_images import hostile, odd_but_valid

PNG = b"\x89PNG\r\n\x1a\n" + b"not decoded by the front door"
EDIT_INPUTS = {"prompt": InputType("TYPE_STRING"), "height": InputType("TYPE_INT32"),
               "width": InputType("TYPE_INT32"), "num_images": InputType("TYPE_INT32"),
               "preview_interval": InputType("TYPE_INT32"), "seed": InputType("TYPE_INT64"),
               "num_inference_steps": InputType("TYPE_INT32"), "strength": InputType("TYPE_FP32"),
               "negative_prompt": InputType("TYPE_STRING"), "cfg_interval": InputType("TYPE_FP32", 2),
               "image": InputType("TYPE_STRING"), "mask_image": InputType("TYPE_STRING")}


class EditGateway(OneModelGateway):
    """Four ready models: `m` takes an image and a mask, `img2img` an image alone, `plain` neither, `multi` one or
    more images (dims [-1]); `sent` records each request's inputs."""

    sent: list = []

    async def ready_models(self) -> list[str]:
        return ["m", "img2img", "plain", "multi"]

    async def _config(self, model: str):
        if model not in ("m", "img2img", "plain", "multi"):
            raise RuntimeError(f"no model {model}")
        left_out = {"m": (), "img2img": ("mask_image",), "plain": ("image", "mask_image"),
                    "multi": ("mask_image",)}[model]
        inputs = {k: v for k, v in EDIT_INPUTS.items() if k not in left_out}
        if model == "multi":
            inputs["image"] = InputType("TYPE_STRING", -1)
        return inputs, {"image"}, 2

    async def stream(self, model, tensors, request_id, parameters=None):
        EditGateway.sent.append({t.name(): t._get_content() for t in tensors})
        for step in (1, 2):
            yield Response(step=step, num_steps=2, is_final=step == 2, images=np.full((1, 8, 8, 3), step, np.uint8),
                           outputs={"step": np.array([step], np.int32)})


@pytest.fixture
def http(monkeypatch):
    monkeypatch.setattr(app_module, "TritonGateway", EditGateway)
    EditGateway.sent = []
    with TestClient(app_module.create_app("fake:1"), raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.fixture
def client(http):
    return openai.OpenAI(api_key="unused", base_url="http://testserver/v1", http_client=http, max_retries=0)


def test_an_edit_sends_the_file_and_the_typed_extra_fields(client):
    result = client.images.edit(model="m", image=("in.png", io.BytesIO(PNG), "image/png"), prompt="in winter",
                                size="16x8", n=1, extra_body={"strength": 0.6, "seed": 1, "num_inference_steps": 4,
                                                              "negative_prompt": "4", "cfg_interval": [0.1, 0.9]})
    assert len(result.data) == 1 and result.size == "16x8"
    sent = EditGateway.sent[-1]
    assert set(sent) == {"prompt", "num_images", "width", "height", "strength", "seed", "num_inference_steps",
                         "negative_prompt", "cfg_interval", "image"}
    assert sent["image"].endswith(PNG)  # the file as it came (BYTES, after Triton's 4-byte length)
    assert np.frombuffer(sent["strength"], np.float32).tolist() == [np.float32(0.6)]
    assert np.frombuffer(sent["seed"], np.int64).tolist() == [1]
    assert np.frombuffer(sent["num_inference_steps"], np.int32).tolist() == [4]
    assert np.frombuffer(sent["cfg_interval"], np.float32).tolist() == [np.float32(0.1), np.float32(0.9)]
    assert sent["negative_prompt"].endswith(b"4")  # a text input stays text


def test_an_edit_of_several_images_sends_every_file_as_one_input(client):
    """A model whose `image` takes one or more files (dims [-1]: Qwen-Image-Edit-Plus) gets them all, in order, as
    the elements of one input; how many it allows is its own check."""
    files = [PNG + b"a", PNG + b"bb"]
    client.images.edit(model="multi", image=[("a.png", files[0]), ("b.png", files[1])], prompt="x")
    assert EditGateway.sent[-1]["image"] == b"".join(struct.pack("<I", len(f)) + f for f in files)
    client.images.edit(model="multi", image=("a.png", files[0]), prompt="x")
    assert EditGateway.sent[-1]["image"] == struct.pack("<I", len(files[0])) + files[0]


def test_an_edit_streams_its_events_as_image_edit(client):
    events = list(client.images.edit(model="m", image=("in.png", PNG), prompt="x", stream=True, partial_images=1))
    assert [e.type for e in events] == ["image_edit.partial_image", "image_edit.completed"]


@pytest.mark.parametrize("kwargs, param", [
    (dict(model="plain"), "model"),
    (dict(image=[("a.png", PNG), ("b.png", PNG)]), "image"),
    (dict(model="img2img", mask=("mask.png", PNG)), "mask"),
    (dict(extra_body={"num_inference_steps": 2.5}), "num_inference_steps"),
    (dict(extra_body={"seed": "one"}), "seed"),
    (dict(extra_body={"strength": "NaN"}), "strength"),
    (dict(extra_body={"height": 64}), "height"),
    (dict(extra_body={"unknown": 1}), "unknown"),
    (dict(n="two"), "n"),
    (dict(stream="yes"), "stream"),
    (dict(size="64"), "size"),
    (dict(output_format="jpeg"), "output_format"),
])
def test_a_bad_edit_is_a_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.images.edit(**{"model": "m", "image": ("in.png", PNG), "prompt": "x", **kwargs})
    assert info.value.param == param, info.value.body
    assert EditGateway.sent == []


def test_an_edit_without_its_image_or_prompt_or_form_is_a_400(http):
    no_file = {"model": (None, "m")}  # a text part: multipart even without a file
    for files, data, param in ((no_file, {"prompt": "x"}, "image"),
                               ({"image": ("in.png", PNG)}, {"model": "m"}, "prompt"),
                               (no_file, {"prompt": "x", "image": "text"}, "image"),
                               ({"other": ("o.png", PNG)}, {"model": "m", "prompt": "x"}, "other")):
        reply = http.post("/v1/images/edits", files=files, data=data)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    for body, content_type in ((b'{"prompt": "x"}', "application/json"), (b"--x\r\nbroken", "multipart/form-data"),
                               (b"--x\r\nbroken", "multipart/form-data; boundary=x"), (b"\xff" * 100, "")):
        reply = http.post("/v1/images/edits", content=body, headers={"Content-Type": content_type})
        assert reply.status_code == 400 and set(reply.json()["error"]) == {"message", "type", "param", "code"}
    assert EditGateway.sent == []


def test_the_edit_body_cap_holds_one_image_and_no_more(http):
    """A file of MAX_IMAGE_BYTES passes (the model decides on it); a larger file is a 413 naming image; a body
    past the edit cap is a 413; the JSON endpoints keep their 1 MiB."""
    form = {"model": "m", "prompt": "x"}
    assert http.post("/v1/images/edits", files={"image": ("in.png", PNG.ljust(MAX_IMAGE_BYTES, b"\0"))},
                     data=form).status_code == 200
    reply = http.post("/v1/images/edits", files={"image": ("in.png", PNG.ljust(MAX_IMAGE_BYTES + 1, b"\0"))},
                      data=form)
    assert reply.status_code == 413 and reply.json()["error"]["param"] == "image", reply.text
    reply = http.post("/v1/images/edits", files={"image": ("in.png", b"\0" * (app_module.MAX_EDIT_BODY_BYTES + 1))},
                      data=form)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "body_too_large"
    assert http.post("/v1/images/generations", json={"model": "m", "prompt": "x" * (2 << 20)}).status_code == 413
    assert len(EditGateway.sent) == 1
    assert http.get("/v1/models").status_code == 200


def test_no_hostile_form_value_in_any_field_is_a_500(http):
    for field in ("model", "n", "seed", "cfg_interval[]", "image[]"):  # each kind of field: text, JSON, a list
        for value in HOSTILE_VALUES + ["\ud800", '"\\ud800"', "\0"]:
            data = {"model": "m", "prompt": "x", field: value.encode("utf-8", "surrogatepass")}
            reply = http.post("/v1/images/edits", files={"image": ("in.png", PNG)}, data=data)
            assert reply.status_code < 500, (field, value[:20], reply.text[:200])
            assert reply.status_code == 200 or "error" in reply.json()


def test_an_edit_sends_its_mask_as_mask_image(client, http):
    mask = PNG + b" mask"
    client.images.edit(model="m", image=("in.png", PNG), mask=("mask.png", mask), prompt="x")
    sent = EditGateway.sent[-1]
    assert sent["image"].endswith(PNG) and sent["mask_image"].endswith(mask)
    for files, data in (({"image": ("in.png", PNG)}, {"mask": "text"}),
                        ([("image", ("in.png", PNG)), ("mask", ("a.png", PNG)), ("mask", ("b.png", PNG))], {})):
        reply = http.post("/v1/images/edits", files=files, data={"model": "m", "prompt": "x", **data})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "mask", reply.text
    with pytest.raises(openai.BadRequestError) as info:  # generations: a mask comes as an edit's file only
        client.images.generate(model="m", prompt="x", extra_body={"mask_image": "aGk="})
    assert info.value.param == "mask_image"
    assert len(EditGateway.sent) == 1


def test_an_image_and_a_mask_share_the_files_cap(http):
    """Each file within MAX_IMAGE_BYTES, both within MAX_EDIT_FILES_BYTES (their request fits the gRPC gate's
    16 MiB message): past it a 413 naming the file that crossed it."""
    form = {"model": "m", "prompt": "x"}
    image = PNG.ljust(MAX_IMAGE_BYTES, b"\0")
    fits = PNG.ljust(app_module.MAX_EDIT_FILES_BYTES - MAX_IMAGE_BYTES, b"\0")
    assert http.post("/v1/images/edits", files={"image": ("in.png", image), "mask": ("m.png", fits)},
                     data=form).status_code == 200
    reply = http.post("/v1/images/edits", files={"image": ("in.png", image), "mask": ("m.png", fits + b"\0")},
                      data=form)
    assert reply.status_code == 413 and reply.json()["error"]["param"] == "mask", reply.text
    assert app_module.MAX_EDIT_FILES_BYTES + (1 << 20) < 16 << 20  # the gate's default message limit
    assert len(EditGateway.sent) == 1


class DecodingGateway(EditGateway):
    """`m` decodes its image inputs as the model does at admission and answers INVALID_ARG as Triton would."""

    async def stream(self, model, tensors, request_id, parameters=None):
        for tensor in tensors:
            if tensor.name() in ("image", "mask_image"):
                try:
                    decode_image(tensor._get_content()[4:], tensor.name())  # after Triton's 4-byte length
                except InvalidInputError as exc:
                    raise TritonRequestError(f"INVALID_ARG: [request id: {request_id}] {exc}") from None
        async for response in super().stream(model, tensors, request_id, parameters):
            yield response


def test_hostile_files_are_refused_naming_image_or_mask(http, monkeypatch):
    """The hostile list as the image and as the mask: a 400 naming the field the model's error names (a file
    over MAX_IMAGE_BYTES: the front door's 413 naming it; a body over the edit cap: a 413 before any part is
    read); the odd but valid files go through, and so does a good edit after them."""
    monkeypatch.setattr(app_module, "TritonGateway", DecodingGateway)
    good = odd_but_valid()["rgba"]
    with TestClient(app_module.create_app("fake:1"), raise_server_exceptions=False) as door:
        for name, (data, fragment) in {**hostile(), "zeros-9MB": (b"\0" * (9 << 20), "")}.items():
            for field in ("image", "mask"):
                files = {"image": ("in.png", good), "mask": ("m.png", good), field: ("f.png", data)}
                reply = door.post("/v1/images/edits", files=files, data={"model": "m", "prompt": "x"})
                error = reply.json()["error"]
                if len(data) > app_module.MAX_EDIT_BODY_BYTES:
                    assert (reply.status_code, error["code"]) == (413, "body_too_large"), (name, field, reply.text)
                elif len(data) > MAX_IMAGE_BYTES:
                    assert (reply.status_code, error["param"]) == (413, field), (name, field, reply.text)
                else:
                    assert (reply.status_code, error["param"]) == (400, field), (name, field, reply.text)
                    assert fragment in error["message"], (name, field, error)
        for name, data in odd_but_valid().items():
            reply = door.post("/v1/images/edits", files={"image": ("in.png", good), "mask": ("m.png", data)},
                              data={"model": "m", "prompt": "x"})
            assert reply.status_code == 200, (name, reply.text)
    assert len(EditGateway.sent) == len(odd_but_valid())


def test_an_edit_answered_as_urls_serves_each_png_to_its_key_only(monkeypatch, tmp_path):
    """response_format "url" on an edit: without OPENAI_PUBLIC_URL the URL is under the address asked; it serves
    the PNG the same edit gets inline, to the key that made it (another key: 404, none: 401)."""
    import base64

    from engine_lib.serving.openai_api.keys import FrontDoorKeys
    from engine_lib.serving.openai_api.store import SQLiteStore

    monkeypatch.setattr(app_module, "TritonGateway", EditGateway)
    monkeypatch.delenv("OPENAI_PUBLIC_URL", raising=False)
    app = app_module.create_app("fake:1", FrontDoorKeys("alice", {"bob": 1}), SQLiteStore(tmp_path))
    with TestClient(app, raise_server_exceptions=False) as http:
        alice = openai.OpenAI(api_key="alice", base_url="http://testserver/v1", http_client=http, max_retries=0)
        ask = dict(model="m", image=("in.png", io.BytesIO(PNG), "image/png"), prompt="in winter", size="16x8",
                   extra_body={"seed": 2, "url_ttl": 90})
        url = alice.images.edit(response_format="url", **ask).data[0].url
        ask["image"], ask["extra_body"] = ("in.png", io.BytesIO(PNG), "image/png"), {"seed": 2}
        inline = alice.images.edit(**ask).data[0].b64_json
        assert url.startswith("http://testserver/v1/files/file_") and url.endswith("/content")
        reply = http.get(url, headers={"Authorization": "Bearer alice"})
        assert reply.status_code == 200 and reply.headers["content-type"] == "image/png"
        assert reply.content == base64.b64decode(inline)
        assert http.get(url, headers={"Authorization": "Bearer bob"}).status_code == 404
        assert http.get(url).status_code == 401
