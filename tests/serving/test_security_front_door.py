"""The front door as a hostile client sees it: bearer keys, priority rights, and malformed input.

Most tests run the app in-process (FastAPI's TestClient) over a fake gateway that records what
would reach Triton; the session's `secured` launcher (every key set) checks the same on the
served stack.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from starlette.requests import Request

from engine_lib.serving.openai_api import app as app_module
from engine_lib.serving.openai_api.gateway import InputType, Response
from engine_lib.serving.openai_api.keys import FrontDoorKeys, parse_priority_keys
from engine_lib.serving.openai_api.requests import OpenAIError
from tests.helpers.fake_gateway import HOSTILE_VALUES, OneModelGateway
from tests.helpers.launched import FRONT_DOOR_KEY, URGENT_FRONT_DOOR_KEY, raw_post

API_KEY, URGENT_KEY, SOON_KEY, MODEL_KEY = "api-key", "urgent-key", "soon-key", "model-priority-key"
INPUTS = {"prompt": InputType("TYPE_STRING"), "height": InputType("TYPE_INT32"), "width": InputType("TYPE_INT32"),
          "seed": InputType("TYPE_INT64"), "priority": InputType("TYPE_INT32"), "guidance_scale": InputType("TYPE_FP32"),
          "num_images": InputType("TYPE_INT32"), "cfg_interval": InputType("TYPE_FP32", 2)}
ENDPOINTS = ("/v1/images/generations", "/v2/models/m/generate", "/v2/models/m/generate_stream")


class FakeGateway(OneModelGateway):
    """One ready model `m` (default priority level 2) that answers every request with one 8x8 image;
    `sent` records each request's parameters."""

    sent: list = []

    async def _config(self, model: str):
        if model != "m":
            raise RuntimeError(f"no model {model}")
        return INPUTS, {"image"}, 2

    async def stream(self, model, tensors, request_id, parameters=None):
        FakeGateway.sent.append(dict(parameters or {}))
        yield Response(step=1, num_steps=1, is_final=True, images=np.zeros((1, 8, 8, 3), np.uint8),
                       outputs={"step": np.array([1], np.int32)})


@pytest.fixture
def client(monkeypatch):
    """The front door with an API key, a key that may ask priority 1 and one that may ask 2, over FakeGateway."""
    monkeypatch.setattr(app_module, "TritonGateway", FakeGateway)
    FakeGateway.sent = []
    keys = FrontDoorKeys(API_KEY, {URGENT_KEY: 1, SOON_KEY: 2}, MODEL_KEY)
    with TestClient(app_module.create_app("fake:1", keys), raise_server_exceptions=False) as test_client:
        yield test_client


def post(client, path: str, body, key: str = API_KEY, scheme: str = "Bearer"):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=content, headers={"Authorization": f"{scheme} {key}"})


def body_for(path: str, **inputs) -> dict:
    return {"model": "m", "prompt": "x", **inputs} if path.startswith("/v1") else {"prompt": "x", **inputs}


def assert_error(reply, status: int, param: str) -> None:
    """An error of `status` naming `param`, in the endpoint's own shape (OpenAI's, or Triton's for generate)."""
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    if isinstance(error, dict):
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    else:
        assert f"input '{param}'" in error, error


# -- keys --------------------------------------------------------------------------------------------------

def test_priority_keys_parse_strictly_and_never_show_a_key():
    assert parse_priority_keys(" a=1, b==2 ,c2V=3") == {"a": 1, "b=": 2, "c2V": 3}  # a key may hold '='
    assert parse_priority_keys("") == {}
    for text in ("sekrit", "sekrit=", "sekrit=0", "sekrit=x", "ok=1,,", "ok=1,sekrit=-1", "sekrit=1,sekrit=2", "=1"):
        with pytest.raises(ValueError, match="OPENAI_PRIORITY_KEYS entry") as info:
            parse_priority_keys(text)
        assert "sekrit" not in str(info.value)


def test_a_malformed_priority_key_stops_the_front_door_naming_the_entry():
    env = {"PATH": "/usr/bin:/bin", "OPENAI_PRIORITY_KEYS": "good=1,hunter2"}
    done = subprocess.run([sys.executable, "-m", "engine_lib.serving.openai_api", "--port", "1"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "entry 2 of 2" in done.stderr, done.stderr
    assert "hunter2" not in done.stdout + done.stderr


def test_every_key_is_compared_in_constant_time(monkeypatch):
    import hmac

    compared = []
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append(b) or a == b)
    keys = FrontDoorKeys(API_KEY, {URGENT_KEY: 1})
    assert keys.caller(API_KEY).highest is None and keys.caller(URGENT_KEY).highest == 1
    assert keys.caller("guess") is None and keys.caller(None) is None
    assert len(compared) == 8  # each of the 4 looks compared both keys, the first match included


def test_the_bearer_scheme_is_case_insensitive_and_the_key_is_not(client):
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert client.get("/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"}).status_code == 200
    for header in (f"Bearer {API_KEY.upper()}", f"Basic {API_KEY}", API_KEY, "Bearer", ""):
        reply = client.get("/v1/models", headers={"Authorization": header})
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"


def test_openapi_json_needs_the_key_and_there_are_no_docs_pages(client):
    assert client.get("/openapi.json").status_code == 401
    assert "/v1/images/generations" in client.get("/openapi.json", headers={"Authorization": f"bearer {URGENT_KEY}"}
                                                  ).json()["paths"]
    assert client.get("/docs").status_code == 404 and client.get("/redoc").status_code == 404


# -- priority rights ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ENDPOINTS)
def test_priority_rights(client, path):
    """The API key may not pass the model's default (2), SOON_KEY may ask 2, URGENT_KEY 1; a level within
    a priority key's rights goes out with the model's priority key, every other request without it."""
    for key, priority in ((API_KEY, 1), (SOON_KEY, 1)):
        assert_error(post(client, path, body_for(path, priority=priority), key), 403, "priority")
    assert FakeGateway.sent == []
    for key, priority, parameters in ((API_KEY, 2, {}), (API_KEY, 3, {}), (API_KEY, 0, {}), (URGENT_KEY, 1,
                                      {"priority_key": MODEL_KEY}), (SOON_KEY, 2, {"priority_key": MODEL_KEY}),
                                      (URGENT_KEY, None, {})):
        inputs = {} if priority is None else {"priority": priority}
        assert post(client, path, body_for(path, **inputs), key).status_code == 200
        assert FakeGateway.sent.pop() == parameters, (key, priority)


def test_an_open_door_lets_nobody_pass_the_default(monkeypatch):
    monkeypatch.setattr(app_module, "TritonGateway", FakeGateway)
    with TestClient(app_module.create_app("fake:1", FrontDoorKeys(model_key=MODEL_KEY))) as open_door:
        assert_error(open_door.post("/v1/images/generations", json=body_for("/v1", priority=1)), 403, "priority")
        assert open_door.get("/openapi.json").status_code == 200


# -- malformed input ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("raw, field", [(b'"prompt": "\\ud800"', "prompt"), (b'"prompt": "x", "seed": ["\\udfff"]', "seed"),
                                        (b'"prompt": "x", "id": "a\\udbff"', "id"),
                                        (b'"prompt": "x", "\\ud800": 1', "\\ud800")])
def test_a_lone_surrogate_is_a_400_naming_the_field(client, path, raw, field):
    assert_error(post(client, path, b"{" + raw + b"}"), 400, field)


FIELDS = ["model", "prompt", "n", "size", "stream", "partial_images", "quality", "response_format", "id", "seed",
          "priority", "guidance_scale", "cfg_interval", "unknown"]


def test_no_malformed_value_of_any_field_is_a_500(client):
    """Every hostile value in every field, on every endpoint: an answer below 500, errors in the endpoint's shape."""
    for path in ENDPOINTS:
        for field in FIELDS:
            for value in HOSTILE_VALUES:
                base = json.dumps(body_for(path, **({"model": "m"} if field != "model" else {})))[1:-1]
                reply = post(client, path, f'{{{base}, "{field}": {value}}}'.encode(), URGENT_KEY)
                assert reply.status_code < 500, (path, field, value[:20], reply.text[:200])
                assert reply.status_code == 200 or "error" in reply.json()


@pytest.mark.parametrize("body", [b"", b"null", b"[]", b'{"prompt": "x"', b"\xff\xfe{", b"[" * 50_000,
                                  b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}"])
def test_bodies_that_are_no_request_are_a_400(client, body):
    for path in ENDPOINTS:
        reply = client.post(path, content=body, headers={"Authorization": f"Bearer {API_KEY}"})  # no content type
        assert reply.status_code == 400, (path, reply.text)


def test_a_body_announced_over_the_limit_is_refused_unread(client):
    reply = client.post("/v2/models/m/generate", content=b"{}", headers={"Authorization": f"Bearer {API_KEY}",
                                                                        "Content-Length": str(64 << 20)})
    assert reply.status_code == 413


@pytest.mark.parametrize("announced", [False, True])
def test_a_body_over_the_limit_is_read_to_its_end_before_the_413(announced):
    """A client still sending reads the 413 (no reset connection): the body is read and dropped, never kept,
    with or without a Content-Length that already says it is too large."""
    body = b'{"prompt": "' + b"x" * (2 << 20) + b'"}'
    chunks = [{"type": "http.request", "body": body[i:i + 65536], "more_body": i + 65536 < len(body)}
              for i in range(0, len(body), 65536)]
    pending = list(chunks)

    async def receive():
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    headers = [(b"content-length", str(len(body)).encode())] if announced else []
    request = Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive)
    with pytest.raises(OpenAIError) as info:
        asyncio.run(app_module.read_json(request))
    assert info.value.status == 413 and not pending


def read_json_of(messages, delay_s: float = 0.0):
    """app.read_json over a request whose body arrives as `messages` (ASGI receive events), `delay_s` apart."""
    pending = list(messages)

    async def receive():
        await asyncio.sleep(delay_s)
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    request = Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)
    return asyncio.run(app_module.read_json(request))


def test_a_client_gone_during_the_body_ends_the_request_quietly():
    with pytest.raises(OpenAIError) as info:  # not Starlette's ClientDisconnect, which logs a traceback
        read_json_of([{"type": "http.request", "body": b'{"prompt": ', "more_body": True}])
    assert info.value.status == 499


def test_a_body_dribbled_past_the_timeout_is_a_408(monkeypatch):
    monkeypatch.setattr(app_module, "BODY_TIMEOUT_S", 0.3)
    chunks = [{"type": "http.request", "body": b" ", "more_body": True}] * 100
    started = time.monotonic()
    with pytest.raises(OpenAIError) as info:
        read_json_of(chunks, delay_s=0.05)
    assert info.value.status == 408 and time.monotonic() - started < 2


def test_a_lora_error_names_files_not_the_folder(tmp_path):
    from engine_lib.lora import LoraLibrary

    (tmp_path / "toy.safetensors").write_bytes(b"")
    with pytest.raises(Exception) as info:
        LoraLibrary(None, str(tmp_path)).check("nope")
    assert "available: toy" in str(info.value) and str(tmp_path) not in str(info.value)


# -- the served stack (the session's `secured` launcher) --------------------------------------------------------

def front_post(secured, body: dict, key: str, scheme: str = "Bearer", path: str = "/v1/images/generations"):
    return raw_post(secured.front, path, json.dumps(body).encode(), timeout=120,
                    headers={"Authorization": f"{scheme} {key}"})


def test_served_priority_rights(secured):
    request = {"prompt": "urgent", "size": "32x32", "num_inference_steps": 2, "priority": 1}
    status, reply = front_post(secured, request, FRONT_DOOR_KEY)
    assert status == 403 and json.loads(reply)["error"]["param"] == "priority", reply
    status, reply = front_post(secured, request, URGENT_FRONT_DOOR_KEY, scheme="bearer")
    assert status == 200 and len(json.loads(reply)["data"]) == 1, reply[:300]
    status, reply = front_post(secured, {"prompt": "x", "num_inference_steps": 2, "height": 32, "width": 32,
                                         "priority": 1}, URGENT_FRONT_DOOR_KEY, path="/v2/models/qwen_image/generate")
    assert status == 200, reply[:300]


def test_served_keys_surrogates_and_openapi(secured):
    assert front_post(secured, {"prompt": "x"}, "wrong")[0] == 401
    status, reply = raw_post(secured.front, "/v1/images/generations", b'{"prompt": "\\ud800"}',
                             headers={"Authorization": f"bearer {FRONT_DOOR_KEY}"})
    assert status == 400 and json.loads(reply)["error"]["param"] == "prompt", reply
    from tests.helpers.launched import http_status

    assert http_status(f"{secured.front_url}/openapi.json") == 401
    assert http_status(f"{secured.front_url}/openapi.json", {"Authorization": f"Bearer {FRONT_DOOR_KEY}"}) == 200


def test_clients_gone_mid_upload_leave_no_traceback(secured):
    before = secured.log() + secured.triton_log.read_text(errors="replace")
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", secured.front)) as sock:
            sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                         + FRONT_DOOR_KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
    time.sleep(0.5)
    assert front_post(secured, {"prompt": "x"}, "wrong")[0] == 401  # still serving
    after = secured.log() + secured.triton_log.read_text(errors="replace")
    added = after[len(before):] if after.startswith(before) else after
    assert "Traceback" not in added and added.count("\n") <= 20, added[-2000:]
