"""`/v1/chat/completions` (and a thought as `revised_prompt`) in-process: the official SDK over FastAPI's TestClient
and a fake gateway that records what would reach Triton (the served check against BAGEL, equal to gRPC's
`output_modality=text` answer, is in test_other_pipelines.py)."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient

from engine_lib.serving.openai_api import app as app_module
from engine_lib.serving.openai_api.gateway import InputType, Response, TritonRequestError
from tests.helpers.fake_gateway import HOSTILE_VALUES, OneModelGateway

INPUTS = {"prompt": InputType("TYPE_STRING"), "output_modality": InputType("TYPE_STRING"),
          "max_new_tokens": InputType("TYPE_INT32"), "temperature": InputType("TYPE_FP32"),
          "seed": InputType("TYPE_INT64"), "think": InputType("TYPE_BOOL"), "height": InputType("TYPE_INT32"),
          "width": InputType("TYPE_INT32"), "priority": InputType("TYPE_INT32")}
PIECES = ["Hel", "lo, ", "wor"]  # streamed; the final holds "Hello, world": its last "ld" never came as a piece
ANSWER = "Hello, world"


def text(array) -> str:
    return array[4:].decode("utf-8")  # a BYTES tensor's one element, after its 4-byte length


class ChatGateway(OneModelGateway):
    """`m` answers in text (BAGEL's inputs and outputs), `painter` only draws; `sent` records each request's inputs.
    A text request streams PIECES, then ends with ANSWER, `length` at max_new_tokens <= 12; prompt `refused` is an
    error before any response, `breaks` one after the first piece. An image request with think sends a thought."""

    sent: list = []

    async def ready_models(self, output: str = "image") -> list[str]:
        return ["m"] if output == "text" else ["m", "painter"]

    async def _config(self, model: str):
        if model == "painter":
            return {"prompt": INPUTS["prompt"]}, {"image"}, 2
        return INPUTS, {"image", "text", "finish_reason"}, 2

    async def stream(self, model, tensors, request_id, parameters=None):
        sent = {t.name(): t._get_content() for t in tensors}
        ChatGateway.sent.append(sent)
        prompt = text(sent["prompt"])
        if prompt == "refused":
            raise TritonRequestError("INVALID_ARG: [request id: x] input 'max_new_tokens': must be in [1, 4096]")
        if "output_modality" not in sent:
            thought = {"text": np.array([b"a plan"], dtype=object)} if "think" in sent else {}
            yield Response(step=1, num_steps=1, is_final=True, images=np.zeros((1, 8, 8, 3), np.uint8), outputs=thought)
            return
        for step, piece in enumerate(PIECES, 1):
            if prompt == "breaks" and step == 2:
                raise TritonRequestError("INTERNAL: the model failed")
            yield Response(step=step, num_steps=4, is_final=False, images=None,
                           outputs={"text": np.array([piece.encode()], dtype=object)})
        capped = np.frombuffer(sent.get("max_new_tokens", np.int32(999).tobytes()), np.int32)[0] <= 12
        yield Response(step=4, num_steps=4, is_final=True, images=None,
                       outputs={"text": np.array([ANSWER.encode()], dtype=object),
                                "finish_reason": np.array([b"length" if capped else b"stop"], dtype=object)})


@pytest.fixture
def http(monkeypatch):
    monkeypatch.setattr(app_module, "TritonGateway", ChatGateway)
    ChatGateway.sent = []
    with TestClient(app_module.create_app("fake:1"), raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.fixture
def client(http):
    return openai.OpenAI(api_key="unused", base_url="http://testserver/v1", http_client=http, max_retries=0)


def ask(client, content="hi", **kwargs):
    return client.chat.completions.create(**{"model": "m", "messages": [{"role": "user", "content": content}],
                                             **kwargs})


def test_a_chat_sends_its_user_message_and_fields_as_the_models_text_inputs(client):
    result = ask(client, "what is red?", max_tokens=30, temperature=0.5, seed=3, extra_body={"think": True})
    sent = ChatGateway.sent[-1]
    assert set(sent) == {"prompt", "output_modality", "max_new_tokens", "temperature", "seed", "think"}
    assert (text(sent["prompt"]), text(sent["output_modality"])) == ("what is red?", "text")
    assert np.frombuffer(sent["max_new_tokens"], np.int32).tolist() == [30]
    assert np.frombuffer(sent["temperature"], np.float32).tolist() == [0.5]
    assert np.frombuffer(sent["seed"], np.int64).tolist() == [3]
    assert np.frombuffer(sent["think"], np.bool_).tolist() == [True]
    assert result.object == "chat.completion" and result.model == "m" and len(result.choices) == 1
    assert result.choices[0].message.role == "assistant" and result.choices[0].message.content == ANSWER
    assert result.choices[0].finish_reason == "stop"


def test_text_parts_are_joined_and_max_completion_tokens_is_max_new_tokens(client):
    result = ask(client, [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], max_completion_tokens=12)
    assert text(ChatGateway.sent[-1]["prompt"]) == "a\nb"
    assert np.frombuffer(ChatGateway.sent[-1]["max_new_tokens"], np.int32).tolist() == [12]
    assert result.choices[0].finish_reason == "length"


def test_a_streamed_chat_sends_each_piece_then_the_rest_of_the_final_text_then_done(client, http):
    chunks = list(ask(client, stream=True, max_tokens=12))
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta.content for c in chunks[1:-1]]
    assert deltas == [*PIECES, "ld"] and "".join(deltas) == ANSWER
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    raw = http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                  "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.endswith('"finish_reason": "stop"}]}\n\ndata: [DONE]\n\n')


def test_an_error_before_the_answer_is_a_400_naming_the_chat_field_and_after_it_an_error_event(client):
    for tokens in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as info:
            ask(client, "refused", stream=True, **{tokens: 5})
        assert info.value.param == tokens and "must be in [1, 4096]" in info.value.message
    with pytest.raises(openai.APIError, match="the model failed"):
        list(ask(client, "breaks", stream=True))


@pytest.mark.parametrize("kwargs, param", [
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]), "messages"),
    (dict(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "and?"}]), "messages"),
    (dict(messages=[{"role": "assistant", "content": "hi"}]), "messages"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), "messages"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(max_completion_tokens="ten"), "max_completion_tokens"),
    (dict(max_tokens=5, max_completion_tokens=6), "max_completion_tokens"),
    (dict(temperature="hot"), "temperature"),
    (dict(seed="one"), "seed"),
    (dict(n=2), "n"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(extra_body={"stream": "yes"}), "stream"),
    (dict(extra_body={"prompt": "x"}), "prompt"),
    (dict(extra_body={"output_modality": "image"}), "output_modality"),
    (dict(extra_body={"top_k": 5}), "top_k"),
    (dict(extra_body={"think": "yes"}), "think"),
])
def test_a_bad_chat_is_a_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**{"model": "m", "messages": [{"role": "user", "content": "hi"}], **kwargs})
    assert info.value.param == param, info.value.body
    assert ChatGateway.sent == []


def test_a_client_that_leaves_the_stream_closes_its_triton_request():
    """Starlette closes the chunks' generator when the client goes away; that closes the gateway's stream, which
    cancels the Triton request (gateway.py)."""
    import asyncio

    from engine_lib.serving.openai_api.chat import ChatRequest, chunks

    closed = []

    async def responses():
        try:
            for step in range(1, 100):
                yield Response(step=step, num_steps=99, is_final=False, images=None,
                               outputs={"text": np.array([b"x"], dtype=object)})
        finally:
            closed.append(True)

    async def leave_after_two():
        stream = responses()
        first = await stream.__anext__()
        events = chunks(ChatRequest("m"), "chatcmpl-1", first, stream)
        assert [await events.__anext__() for _ in range(3)][-1].count('"content": "x"') == 1
        await events.aclose()

    asyncio.run(leave_after_two())
    assert closed == [True]


def test_no_malformed_value_of_any_chat_field_is_a_500_and_priority_keeps_its_rights(http):
    for field in ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "seed", "stream",
                  "stream_options", "n", "think", "priority", "unknown"):
        for value in [*HOSTILE_VALUES, '[{"role": "user", "content": [{"type": "text", "text": 1}]}]']:
            base = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})[1:-1]
            reply = http.post("/v1/chat/completions", content=f'{{{base}, "{field}": {value}}}'.encode())
            assert reply.status_code < 500 and (reply.status_code == 200 or "error" in reply.json()), (field, value)
    reply = http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                    "priority": 1})
    assert reply.status_code == 403 and reply.json()["error"]["param"] == "priority"


def test_a_model_that_does_not_answer_in_text_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        ask(client, model="painter")
    assert info.value.param == "model" and "m" in info.value.message


def test_a_thought_comes_back_as_each_images_revised_prompt(client):
    assert client.images.generate(model="m", prompt="x", extra_body={"think": True}).data[0].revised_prompt == "a plan"
    assert client.images.generate(model="m", prompt="x").data[0].revised_prompt is None


def test_a_chat_needs_the_key_when_one_is_set(monkeypatch):
    from engine_lib.serving.openai_api.keys import FrontDoorKeys

    monkeypatch.setattr(app_module, "TritonGateway", ChatGateway)
    with TestClient(app_module.create_app("fake:1", FrontDoorKeys("s3cret")),
                    raise_server_exceptions=False) as http:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        assert http.post("/v1/chat/completions", json=body).status_code == 401
        answer = http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert answer.json()["choices"][0]["message"]["content"] == ANSWER
