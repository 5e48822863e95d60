"""Python API of the client: `generate()` for images, `stream()` for progress too.

Both talk to the decoupled diffusion models of this repository over gRPC
streaming (tritonclient) or HTTP `generate_stream` (server-sent events). Only
the inputs the caller sets are sent; the server applies its defaults to the rest.
"""

from __future__ import annotations

import base64
from typing import Any, Dict, Iterator, List, Optional, Union

from PIL import Image

from client.events import Final, Progress, ServerError

DEFAULT_URLS = {"grpc": "localhost:8001", "http": "localhost:8000"}
DEFAULT_TIMEOUT_S = 600.0

# Triton datatype of every input the models accept (docs/serving.md, Inputs; docs/pipelines.md per pipeline).
INPUT_DTYPES = {
    "prompt": "BYTES",
    "negative_prompt": "BYTES",
    "height": "INT32",
    "width": "INT32",
    "num_inference_steps": "INT32",
    "guidance_scale": "FP32",
    "true_cfg_scale": "FP32",
    "seed": "INT64",
    "num_images": "INT32",
    "num_frames": "INT32",
    "frame_rate": "FP32",
    "preview_interval": "INT32",
    "output_format": "BYTES",
    "image": "BYTES",
    "strength": "FP32",
    "mask_image": "BYTES",
    "cache": "BYTES",
    "cache_threshold": "FP32",
    "think": "BOOL",
    "output_modality": "BYTES",
    "max_new_tokens": "INT32",
    "temperature": "FP32",
}


def build_inputs(
    prompt: str,
    *,
    steps: Optional[int] = None,
    height: Optional[int] = None,
    width: Optional[int] = None,
    seed: Optional[int] = None,
    negative_prompt: Optional[str] = None,
    true_cfg_scale: Optional[float] = None,
    guidance_scale: Optional[float] = None,
    num_images: Optional[int] = None,
    num_frames: Optional[int] = None,
    frame_rate: Optional[float] = None,
    preview_interval: int = 0,
    output_format: Optional[str] = None,
    image: Optional[Union[bytes, List[bytes]]] = None,
    strength: Optional[float] = None,
    mask: Optional[bytes] = None,
    cache: Optional[str] = None,
    cache_threshold: Optional[float] = None,
    think: Optional[bool] = None,
    output_modality: Optional[str] = None,
    max_new_tokens: Optional[int] = None,
    temperature: Optional[float] = None,
) -> Dict[str, Any]:
    """The request's inputs by Triton name, leaving out everything not set. `image` (an encoded file, for
    image-to-image, or a list of them: qwen_image_edit_plus's one [n] input) and `mask` (one more, for inpainting:
    `mask_image`) are sent as base64 text, which the server takes over gRPC and HTTP alike."""
    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode("ascii")

    values = {
        "prompt": prompt,
        "negative_prompt": negative_prompt,
        "height": height,
        "width": width,
        "num_inference_steps": steps,
        "guidance_scale": guidance_scale,
        "true_cfg_scale": true_cfg_scale,
        "seed": seed,
        "num_images": num_images,
        "num_frames": num_frames,
        "frame_rate": frame_rate,
        "preview_interval": preview_interval or None,  # 0 is the server's default
        "output_format": output_format,
        "image": None if image is None else [b64(f) for f in image] if isinstance(image, list) else b64(image),
        "strength": strength,
        "mask_image": None if mask is None else base64.b64encode(mask).decode("ascii"),
        "cache": cache,
        "cache_threshold": cache_threshold,
        "think": think,
        "output_modality": output_modality,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
    }
    return {name: value for name, value in values.items() if value is not None}


def stream(
    prompt: str,
    *,
    url: Optional[str] = None,
    protocol: str = "grpc",
    model: str = "qwen_image",
    timeout: Optional[float] = DEFAULT_TIMEOUT_S,
    output_format: Optional[str] = None,
    **params: Any,
) -> Iterator[Union[Progress, Final]]:
    """Yield Progress events, then one Final, for one generation request.

    `url` defaults to localhost:8001 (gRPC) or localhost:8000 (HTTP). Over HTTP
    images are asked for as PNG (a raw tensor would travel as a JSON number
    list) unless `output_format` says otherwise (videos: pass "mp4" or "raw"). Closing the iterator early
    (or Ctrl-C while it waits) cancels the request: gRPC cancels the stream,
    HTTP closes the connection. Other parameters: see `build_inputs`.
    Raises ServerError (Triton's message), ServerUnreachableError,
    RequestTimeoutError.
    """
    if protocol not in DEFAULT_URLS:
        raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")
    if protocol == "http" and output_format is None:
        output_format = "png"
    inputs = build_inputs(prompt, output_format=output_format, **params)
    url = url or DEFAULT_URLS[protocol]
    if protocol == "grpc":
        from client.grpc_transport import grpc_events

        return grpc_events(url, model, inputs, INPUT_DTYPES, timeout)
    from client.http_transport import http_events

    return http_events(url, model, inputs, timeout)


def answer(prompt: str, **kwargs: Any) -> str:
    """A text answer to `prompt` (BAGEL: `output_modality="text"`); same arguments as `stream`."""
    final = None
    for event in stream(prompt, output_modality="text", **kwargs):
        if isinstance(event, Final):
            final = event
    if final is None or final.text is None:
        raise ServerError("the server ended the request without a final text")
    return final.text


def generate(prompt: str, **kwargs: Any) -> List[Image.Image]:
    """Generate images for `prompt` and return them; same arguments as `stream`."""
    final = None
    for event in stream(prompt, **kwargs):
        if isinstance(event, Final):
            final = event
    if final is None:
        raise ServerError("the server ended the request without a final image")
    return final.images
