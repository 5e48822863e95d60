"""`/v1/chat/completions` for the models that answer in text: those with a `text` output and an `output_modality`
input (BAGEL), asked with `output_modality=text`.

The body is OpenAI's chat body, mapped onto the model's inputs:

- `messages`: exactly one `user` message; its content (a string, or `text` parts joined by a newline) is the
  `prompt`. Earlier turns and `system`/`developer` messages are refused (400 naming `messages`): the model takes
  one prompt, and its system prompts are its own (`think` picks them), so there is no faithful place for them.
- `max_tokens` or `max_completion_tokens` -> `max_new_tokens`; `temperature`, `seed` as they are; `n` only 1;
  `user` ignored; `stream_options` only without usage (the models count no tokens here).
- any other input the model declares (`think`, `priority`, ...) as an extra field, as the Images API takes it.

The answer is a `chat.completion` with the whole text and the model's `finish_reason` (`stop` at its end token,
`length` at `max_new_tokens`). Streamed (`stream: true`), each new piece of text the model sends is a
`chat.completion.chunk` delta (the first one names the role), then a chunk with the `finish_reason`, then
`data: [DONE]`. Errors, client disconnects and keys are as for the images endpoints (app.py).
"""

from __future__ import annotations

import itertools
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping, Optional

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from engine_lib.request import InvalidInputError
from engine_lib.serving.openai_api.gateway import InputType, Response, TritonGateway, TritonRequestError
from engine_lib.serving.openai_api.keys import Caller, FrontDoorKeys
from engine_lib.serving.openai_api.requests import OpenAIError, bad_request, error_from_triton, extra_inputs
from engine_lib.serving.openai_api.watch import next_response, until_final

CHAT_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "seed", "stream",
               "stream_options", "n", "user")
# Model inputs the chat body sets itself (-> the field that sets it): not accepted as extra fields.
MANAGED_INPUTS = {"prompt": "messages", "output_modality": "model", "max_new_tokens": "max_tokens",
                  "temperature": "temperature", "seed": "seed"}


async def text_model_inputs(gateway: TritonGateway, model: Any) -> tuple[dict[str, InputType], Optional[str]]:
    """(the declared inputs of the model asked for, or of the only one that answers in text; the default model): 404
    for a model that is not served here or does not answer in text, 503 while Triton is not ready."""
    if not await gateway.server_ready():
        raise OpenAIError(503, f"Triton at {gateway.url} is not ready", code="unavailable", type_="server_error")
    names = [name for name in await gateway.ready_models("text")
             if "output_modality" in await gateway.input_types(name)]
    if model is not None and model not in names:
        raise OpenAIError(404, f"model {model!r} does not answer chats here (those that do: "
                               f"{', '.join(names) or 'none'})", param="model", code="model_not_found")
    default = names[0] if len(names) == 1 else None
    return (await gateway.input_types(model or default) if (model or default) else {}), default


@dataclass
class ChatRequest:
    """One chat request, as the Triton model gets it."""

    model: str
    inputs: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    tokens_field: str = "max_tokens"  # the field that set max_new_tokens, named in its errors

    def param(self, input_name: Optional[str]) -> Optional[str]:
        """The chat field a model input came from."""
        return self.tokens_field if input_name == "max_new_tokens" else MANAGED_INPUTS.get(input_name, input_name)


def parse_chat_request(body: Any, input_types: Mapping[str, Any], default_model: Optional[str]) -> ChatRequest:
    """Map a `/v1/chat/completions` body onto the model's inputs (`input_types`: name -> InputType)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_json")
    model = body.get("model", default_model)
    if not isinstance(model, str) or not model:
        raise bad_request("model is required (GET /v1/models lists the models)", "model", "missing_required_parameter")
    request = ChatRequest(model, {"prompt": prompt_of(body.get("messages"), model), "output_modality": "text"})
    given = [name for name in ("max_tokens", "max_completion_tokens") if body.get(name) is not None]
    if len(given) == 2 and body["max_tokens"] != body["max_completion_tokens"]:
        raise bad_request("max_tokens and max_completion_tokens differ: give one", "max_completion_tokens")
    if given:
        request.tokens_field = given[0]
        request.inputs["max_new_tokens"] = body[given[0]]
    for name in ("temperature", "seed"):
        if body.get(name) is not None:
            request.inputs[name] = body[name]
    if body.get("n") not in (None, 1):  # OpenAI takes null for its defaults
        raise bad_request("n must be 1 (one answer per request)", "n")
    stream = False if body.get("stream") is None else body["stream"]
    if not isinstance(stream, bool):
        raise bad_request("stream must be true or false", "stream")
    request.stream = stream
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}
                                or options.get("include_usage", False) is not False):
        raise bad_request("stream_options may only hold include_usage: false (no tokens are counted here)",
                          "stream_options")
    request.inputs.update(extra_inputs(body, CHAT_FIELDS, MANAGED_INPUTS, input_types, model))
    return request


def prompt_of(messages: Any, model: str) -> str:
    """The prompt of a chat's messages: its one user message's text."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages is required: a list holding one user message", "messages",
                          "missing_required_parameter")
    if len(messages) != 1 or not isinstance(messages[0], dict) or messages[0].get("role") != "user":
        raise bad_request(f"{model} answers one user message: earlier turns and system or developer messages have "
                          f"no place in its prompt (its system prompts are its own: see think)", "messages")
    content = messages[0].get("content")
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "\n".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise bad_request("the message's content must be text: a string or a list of text parts", "messages")
    return content


def chat_error(request: ChatRequest):
    """Triton's error messages as OpenAI errors naming the chat field (max_new_tokens -> max_tokens)."""
    def convert(message: str) -> OpenAIError:
        error = error_from_triton(message)
        named = re.search(r"input '([^']+)'", message)  # not the Images API's names (height is no `size` here)
        error.param = request.param(named.group(1)) if named else error.param
        return error
    return convert


def text_of(response: Response, name: str = "text") -> Optional[str]:
    """A response's one-element text output as str; None when it has none."""
    array = response.outputs.get(name)
    if array is None or not len(array):
        return None
    value = array.ravel()[0]
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def make_router(read_json, authorize, keys: FrontDoorKeys) -> APIRouter:
    """The endpoint; `read_json(request)` is the app's bounded body reader, `authorize` its bearer key dependency
    (the caller), `keys` the callers' priority rights."""
    router = APIRouter(prefix="/v1")
    request_ids = itertools.count(1)

    @router.post("/chat/completions")
    async def chat_completions(request: Request, caller: Caller = Depends(authorize)):
        gateway: TritonGateway = request.app.state.gateway
        body = await read_json(request)
        input_types, default = await text_model_inputs(gateway, body.get("model") if isinstance(body, dict) else None)
        chat = parse_chat_request(body, input_types, default)
        on_error = chat_error(chat)
        try:
            tensors = gateway.tensors(chat.inputs, input_types)
        except InvalidInputError as exc:
            raise bad_request(str(exc), chat.param(exc.input_name)) from None
        parameters = keys.priority_parameters(caller, chat.inputs.get("priority"),
                                              await gateway.default_priority(chat.model))
        request_id = f"chatcmpl-{next(request_ids)}"
        responses = gateway.stream(chat.model, tensors, request_id, parameters)
        if chat.stream:
            first = await next_response(responses, request, on_error=on_error)  # an error first: an HTTP error
            return StreamingResponse(chunks(chat, request_id, first, responses), media_type="text/event-stream")
        final = await until_final(responses, request, on_error=on_error)
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": chat.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text_of(final) or "",
                                                     "refusal": None},
                             "logprobs": None, "finish_reason": text_of(final, "finish_reason") or "stop"}]}

    return router


async def chunks(chat: ChatRequest, request_id: str, first: Response, responses: AsyncIterator[Response]):
    """Server-sent `chat.completion.chunk` events: the role, each new piece of text, the finish reason, [DONE].
    The final response holds the whole text: whatever of it was not streamed yet goes out as the last delta."""
    created = int(time.time())

    def chunk(delta: dict, finish_reason: Optional[str] = None) -> str:
        data = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": chat.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
        return f"data: {json.dumps(data)}\n\n"

    sent = ""
    try:
        yield chunk({"role": "assistant", "content": ""})
        response = first
        while True:
            text = text_of(response)
            if response.is_final:
                if text is not None and text.startswith(sent) and len(text) > len(sent):
                    yield chunk({"content": text[len(sent):]})
                yield chunk({}, text_of(response, "finish_reason") or "stop")
                yield "data: [DONE]\n\n"
                return
            if text:
                sent += text
                yield chunk({"content": text})
            response = await responses.__anext__()
    except TritonRequestError as exc:
        yield f"data: {json.dumps(chat_error(chat)(str(exc)).body())}\n\n"
    except StopAsyncIteration:
        yield f"data: {json.dumps(error_from_triton('INTERNAL: the model ended without a final response').body())}\n\n"
    finally:
        await responses.aclose()  # a client that went away cancels the Triton request here
