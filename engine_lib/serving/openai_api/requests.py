"""The OpenAI Images request body -> one Triton request, and errors in OpenAI's shape.

What the body may hold: OpenAI's own fields (`model`, `prompt`, `n`, `size`,
`response_format` (`b64_json`, or `url` with `url_ttl` seconds, default an hour), `output_format`,
`stream`, `partial_images`, `user`; `quality` and
`background` only at their no-op values), and any input the model declares in its Triton
config (`seed`, `num_inference_steps`, `negative_prompt`, `guidance_scale`, ...), sent as
that input. Anything else is refused naming it. Values are checked by the model itself
(its one validation); its INVALID_ARG errors come back naming the OpenAI field.

An edit (`/v1/images/edits`) is a form of the same fields, typed as the JSON body would be
(`form_body`), plus its `image` file(s), which go to the model's `image` input as they came, and
its `mask` file, which goes to the model's `mask_image` input (inpainting).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

# Model inputs the front door sets itself from OpenAI fields: not accepted as extra fields.
MANAGED_INPUTS = {"prompt": "prompt", "num_images": "n", "height": "size", "width": "size",
                  "output_format": "output_format", "preview_interval": "partial_images", "mask_image": "mask"}
OPENAI_FIELDS = ("model", "prompt", "n", "size", "response_format", "output_format", "stream", "partial_images",
                 "user", "quality", "background", "url_ttl")
TEXT_FIELDS = ("model", "prompt", "size", "response_format", "output_format", "user", "quality", "background")
NO_OP_VALUES = {"quality": ("auto",), "background": ("auto", "opaque")}
MAX_PARTIAL_IMAGES = 3
URL_TTL_S = 3600  # how long a response_format "url" image stays, as OpenAI's URLs (url_ttl changes it)
MAX_URL_TTL_S = 7 * 24 * 3600
SURROGATE = re.compile("[\ud800-\udfff]")  # in a str only as a lone surrogate: JSON's "\ud800" makes one


class OpenAIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: Optional[str], code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


@dataclass
class ImageRequest:
    """One images request, as the Triton model gets it."""

    model: str
    inputs: dict[str, Any] = field(default_factory=dict)  # model input name -> value
    size: str = "auto"  # echoed in the events, as OpenAI does
    stream: bool = False
    partial_images: int = 0
    url_ttl: Optional[int] = None  # response_format "url": seconds each image's URL stays valid; None: b64_json


def parse_size(size: Any) -> tuple[Optional[int], Optional[int]]:
    """"WxH" -> (width, height); "auto" -> the model's defaults."""
    if size == "auto":
        return None, None
    match = re.fullmatch(r"(\d{1,5})x(\d{1,5})", size) if isinstance(size, str) else None
    if match is None:
        raise bad_request(f"size {size!r} is not 'auto' or WIDTHxHEIGHT, e.g. '1024x1024'", "size")
    return int(match.group(1)), int(match.group(2))


def model_name(body: Mapping[str, Any], default_model: Optional[str]) -> str:
    model = body.get("model", default_model)
    if not isinstance(model, str) or not model:
        raise bad_request("model is required (GET /v1/models lists them)", "model", "missing_required_parameter")
    return model


def model_and_prompt(body: Any, default_model: Optional[str]) -> tuple[str, str]:
    """A create body's model and prompt, the two fields every images and videos request needs."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_json")
    model = model_name(body, default_model)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("prompt is required and must be a string", "prompt", "missing_required_parameter")
    return model, prompt


def parse_image_request(body: Any, input_types: Mapping[str, Any], default_model: Optional[str]) -> ImageRequest:
    """Map an `/v1/images/generations` body onto the model's inputs (`input_types`: name -> InputType)."""
    model, prompt = model_and_prompt(body, default_model)
    request = ImageRequest(model, {"prompt": prompt})

    for name, allowed in NO_OP_VALUES.items():
        if name in body and body[name] not in allowed:
            raise bad_request(f"{name} {body[name]!r} is not supported here (only {', '.join(allowed)})", name)
    request.url_ttl = parse_url_ttl(body)
    if body.get("output_format", "png") != "png":
        raise bad_request(f"output_format {body['output_format']!r} is not supported (only png)", "output_format")
    if "n" in body:
        if isinstance(body["n"], bool) or not isinstance(body["n"], int):
            raise bad_request("n must be an integer", "n")
        request.inputs["num_images"] = body["n"]
    if "size" in body:
        request.size = body["size"] if isinstance(body["size"], str) else str(body["size"])
        width, height = parse_size(body["size"])
        if width is not None:
            request.inputs.update(width=width, height=height)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream must be true or false", "stream")
    partial = body.get("partial_images", 0)
    if isinstance(partial, bool) or not isinstance(partial, int) or not 0 <= partial <= MAX_PARTIAL_IMAGES:
        raise bad_request(f"partial_images must be an integer in [0, {MAX_PARTIAL_IMAGES}]", "partial_images")
    request.stream, request.partial_images = stream, partial if stream else 0
    if stream and request.url_ttl is not None:
        raise bad_request("response_format 'url' is not offered with stream: streamed images come as b64_json",
                          "response_format")
    if request.partial_images:
        request.inputs["preview_interval"] = 1  # every step; the front door forwards the ones it needs

    request.inputs.update(extra_inputs(body, OPENAI_FIELDS, MANAGED_INPUTS, input_types, model))
    return request


def parse_url_ttl(body: Mapping[str, Any]) -> Optional[int]:
    """The seconds a "url" image stays (url_ttl, default URL_TTL_S); None for b64_json."""
    response_format = body.get("response_format", "b64_json")
    if response_format not in ("b64_json", "url"):
        raise bad_request(f"response_format {response_format!r} is not b64_json or url", "response_format")
    ttl = body.get("url_ttl", URL_TTL_S)
    if isinstance(ttl, bool) or not isinstance(ttl, int) or not 1 <= ttl <= MAX_URL_TTL_S:
        raise bad_request(f"url_ttl {ttl!r} is not an integer number of seconds in [1, {MAX_URL_TTL_S}]", "url_ttl")
    if "url_ttl" in body and response_format != "url":
        raise bad_request("url_ttl is for response_format 'url' only", "url_ttl")
    return ttl if response_format == "url" else None


def extra_inputs(body: Mapping[str, Any], own_fields, managed: Mapping[str, Any], input_types: Mapping[str, Any],
                 model: str) -> dict[str, Any]:
    """The body's fields other than the endpoint's `own_fields`, as the model's inputs of those names: a field
    the model does not declare, or one of the inputs the endpoint sets itself (`managed`), is a 400 naming it."""
    inputs = {}
    for name, value in body.items():
        if name in own_fields:
            continue
        if name in managed or name not in input_types:
            known = sorted(set(input_types) - set(managed))
            raise bad_request(f"unknown field {name!r}; {model} also takes: {', '.join(known)}", name,
                              "unknown_parameter")
        inputs[name] = value
    return inputs


def parse_edit_request(fields: list[tuple[str, str]], files: list[tuple[str, bytes]], input_types: Mapping[str, Any],
                       default_model: Optional[str]) -> ImageRequest:
    """Map an `/v1/images/edits` form (its text fields and its files, in order) onto the model's inputs: the
    fields as a generations body (typed by `form_body`), the `image` file (or `image[]` files) as the model's
    `image` input, its bytes as they came; the `mask` file, if any, as its `mask_image` input."""
    for name, _ in fields:
        if name in ("image", "image[]", "mask"):
            raise bad_request(f"{name.removesuffix('[]')} must be a file (a multipart file part), not a text field",
                              name.removesuffix("[]"))
    for name, _ in files:
        if name not in ("image", "image[]", "mask"):
            raise bad_request(f"{name!r} is a file; only image and mask take one", name)
    masks = [data for name, data in files if name == "mask"]
    files = [(name, data) for name, data in files if name != "mask"]
    body = form_body(fields, input_types)
    surrogate = lone_surrogate_field(body)  # JSON's "\ud800" in a typed field
    if surrogate is not None:
        raise bad_request(f"input '{surrogate}': holds a lone surrogate, which is not Unicode text", surrogate)
    model = model_name(body, default_model)
    if "image" not in input_types:
        raise bad_request(f"{model} does not take an input image", "model")
    images = [data for _, data in files]
    wanted = input_types["image"].count  # -1: one or more (the model bounds how many)
    if len(images) != wanted and not (wanted == -1 and images):
        raise bad_request(f"{model} takes {'one or more' if wanted == -1 else wanted} image file(s), got {len(images)}",
                          "image",
                          "missing_required_parameter" if not images else "invalid_value")
    if masks and "mask_image" not in input_types:
        raise bad_request(f"{model} does not take a mask (no inpainting)", "mask")
    if len(masks) > 1:
        raise bad_request(f"one mask file, got {len(masks)}", "mask")
    request = parse_image_request(body, input_types, default_model)
    request.inputs["image"] = images[0] if wanted == 1 else images
    if masks:
        request.inputs["mask_image"] = masks[0]
    return request


def form_body(fields: list[tuple[str, str]], input_types: Mapping[str, Any]) -> dict[str, Any]:
    """Form fields (all text) as the JSON body generations would get: a field that is text (an OpenAI text field,
    a string input, an unknown name) as it is, any other parsed as JSON (`4`, `0.6`, `true`; what is no JSON
    stays text and is refused naming it); `name[]` repeated as a list. A field given twice is refused."""
    body: dict[str, Any] = {}
    for name, text in fields:
        key = name.removesuffix("[]")
        declared = input_types.get(key)
        is_text = key in TEXT_FIELDS or (declared.triton_type == "TYPE_STRING" if declared else key not in OPENAI_FIELDS)
        value = text if is_text else json_or_text(text)
        if name.endswith("[]"):
            body.setdefault(key, [])
            if not isinstance(body[key], list):
                raise bad_request(f"{key} is given both as {key} and {key}[]", key)
            body[key].append(value)
        elif key in body:
            raise bad_request(f"{key} is given more than once", key)
        else:
            body[key] = value
    return body


def json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def lone_surrogate_field(body: Any) -> Optional[str]:
    """The first field of an object body whose name, or any text in its value, holds a lone surrogate (shown
    printable); None if none does. Such text cannot be encoded as UTF-8, neither for the model nor in an
    answer that echoes it: each was a 500 with a traceback."""
    if not isinstance(body, dict):
        return None  # refused as no object, without echoing it
    for name, value in body.items():
        stack = [name, value]
        while stack:  # not recursive: a value nests as deep as json.loads allows
            item = stack.pop()
            if isinstance(item, str) and SURROGATE.search(item):
                return name.encode("utf-8", "backslashreplace").decode("utf-8")
            if isinstance(item, dict):
                stack += [*item, *item.values()]
            elif isinstance(item, list):
                stack += item
    return None


def openai_param(input_name: Optional[str]) -> Optional[str]:
    """The OpenAI field a model input came from (height -> size, num_images -> n)."""
    return MANAGED_INPUTS.get(input_name, input_name) if input_name else None


def error_from_triton(message: str) -> OpenAIError:
    """A Triton error message ("CODE: [request id: r] input 'x': ...", or Triton's own wording) in OpenAI's shape."""
    code = message.split(":", 1)[0].strip()
    text = re.sub(r"^[A-Z_]+: (\[request id: [^\]]*\] )?", "", message)
    named = re.search(r"input '([^']+)'", message)
    param = openai_param(named.group(1)) if named else None
    if code == "INVALID_ARG" or (code not in ("UNAVAILABLE", "INTERNAL", "CANCELLED") and named):
        return OpenAIError(400, text, param=param, code="invalid_value")
    if code == "UNAVAILABLE" and "queue full" in message:
        return OpenAIError(429, text, code="rate_limit_exceeded", type_="requests")
    if code == "UNAVAILABLE":
        return OpenAIError(503, text, code="unavailable", type_="server_error")
    if code == "CANCELLED":
        return OpenAIError(499, text, code="cancelled", type_="server_error")
    return OpenAIError(500, text, code="internal_error", type_="server_error")
