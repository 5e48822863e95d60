"""Request tensors -> validated SamplingParams, and engine outputs -> response tensors.

Pure numpy (plus PIL for PNG): importable and testable without Triton. Every
rejection is an InvalidInputError naming the input and what is allowed, so the
Triton edge can answer INVALID_ARG before anything is queued.
"""

from __future__ import annotations

import base64
import io
import math
import secrets
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

from engine_lib.config import EngineConfig
from engine_lib.request import DiffusionOutput, InvalidInputError, SamplingParams

OUTPUT_FORMATS = ("raw", "png")
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class InputSpec:
    """One Triton input: its config.pbtxt datatype and the numpy dtypes that carry it."""

    name: str
    datatype: str  # Triton name, as in the error messages users see
    dtypes: tuple


# The model's inputs (DESIGN.md "Triton interface"); every one is a [1] tensor.
INPUT_SPECS: dict[str, InputSpec] = {
    spec.name: spec
    for spec in (
        InputSpec("prompt", "BYTES", (np.object_, np.bytes_)),
        InputSpec("negative_prompt", "BYTES", (np.object_, np.bytes_)),
        InputSpec("height", "INT32", (np.int32,)),
        InputSpec("width", "INT32", (np.int32,)),
        InputSpec("num_inference_steps", "INT32", (np.int32,)),
        InputSpec("guidance_scale", "FP32", (np.float32,)),
        InputSpec("true_cfg_scale", "FP32", (np.float32,)),
        InputSpec("seed", "INT64", (np.int64,)),
        InputSpec("num_images", "INT32", (np.int32,)),
        InputSpec("preview_interval", "INT32", (np.int32,)),
        InputSpec("output_format", "BYTES", (np.object_, np.bytes_)),
    )
}


def _scalar(name: str, array: Any) -> Any:
    """The single element of a [1] input of the right datatype."""
    spec = INPUT_SPECS[name]
    array = np.asarray(array)
    if array.dtype.type not in spec.dtypes:
        raise InvalidInputError(name, f"datatype must be {spec.datatype}, got {array.dtype}")
    if array.shape != (1,):
        raise InvalidInputError(name, f"shape must be [1], got {list(array.shape)}")
    return array[0]


def _text(name: str, array: Any, max_chars: int) -> str:
    value = _scalar(name, array)
    if isinstance(value, str):  # numpy object arrays built in Python may hold str
        text = value
    else:
        try:
            text = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidInputError(name, "must be UTF-8 text") from None
    if len(text) > max_chars:
        raise InvalidInputError(name, f"{len(text)} characters; at most {max_chars} allowed")
    return text


def _int_in(name: str, array: Any, low: int, high: int) -> int:
    value = int(_scalar(name, array))
    if not low <= value <= high:
        raise InvalidInputError(name, f"{value} is outside the allowed range [{low}, {high}]")
    return value


def _non_negative_float(name: str, array: Any) -> float:
    value = float(_scalar(name, array))
    if not math.isfinite(value) or value < 0:
        raise InvalidInputError(name, f"{value} must be a finite number >= 0")
    return value


def _size(name: str, array: Any, multiple: int, maximum: int) -> int:
    value = int(_scalar(name, array))
    if value < multiple or value > maximum or value % multiple:
        raise InvalidInputError(
            name, f"{value} must be a multiple of {multiple} in the range [{multiple}, {maximum}]"
        )
    return value


def parse_inputs(inputs: Mapping[str, Optional[np.ndarray]], config: EngineConfig,
                 size_multiple: int = 16, adapter: Any = None) -> SamplingParams:
    """Build SamplingParams from a request's input arrays (None or absent: the input was not sent).

    Missing inputs take `config`'s defaults (default_height/width/steps), the
    adapter's `default_inputs` (the diffusers pipeline's own defaults), a random
    seed, or SamplingParams' own. Inputs the adapter does not use are refused. `adapter.validate(params)` runs last, for what only
    the pipeline knows (e.g. a step count its scheduler cannot run).
    """
    given = {name: value for name, value in inputs.items() if value is not None}
    unknown = sorted(set(given) - set(INPUT_SPECS))
    if unknown:
        raise InvalidInputError(unknown[0], f"unknown input; known inputs: {', '.join(INPUT_SPECS)}")
    if "prompt" not in given:
        raise InvalidInputError("prompt", "is required")
    if adapter is not None:
        unused = sorted(set(given) - set(adapter.supported_inputs) - {"prompt"})
        if unused:
            uses = ", ".join(["prompt", *sorted(set(adapter.supported_inputs) & set(INPUT_SPECS))])
            raise InvalidInputError(unused[0], f"{adapter.name} does not use this input (it uses: {uses})")

    # Left-out inputs: the pipeline's own defaults, and a fresh random seed (as diffusers without a generator).
    fields: dict[str, Any] = dict(adapter.default_inputs) if adapter is not None else {}
    fields["seed"] = secrets.randbelow(INT32_MAX)
    fields["prompt"] = _text("prompt", given["prompt"], config.max_prompt_chars)
    if not fields["prompt"].strip():
        raise InvalidInputError("prompt", "must not be empty")
    if "negative_prompt" in given:
        # Passed through as given, "" included: diffusers treats any negative prompt as present.
        fields["negative_prompt"] = _text("negative_prompt", given["negative_prompt"], config.max_prompt_chars)

    fields["height"] = config.default_height
    fields["width"] = config.default_width
    if "height" in given:
        fields["height"] = _size("height", given["height"], size_multiple, config.max_height)
    if "width" in given:
        fields["width"] = _size("width", given["width"], size_multiple, config.max_width)
    fields["num_inference_steps"] = config.default_steps
    if "num_inference_steps" in given:
        fields["num_inference_steps"] = _int_in("num_inference_steps", given["num_inference_steps"],
                                                1, config.max_steps)
    for name in ("guidance_scale", "true_cfg_scale"):
        if name in given:
            fields[name] = _non_negative_float(name, given[name])
    if "seed" in given:
        fields["seed"] = _int_in("seed", given["seed"], 0, INT64_MAX)
    if "num_images" in given:
        fields["num_images"] = _int_in("num_images", given["num_images"], 1, config.max_num_images)
    if "preview_interval" in given:
        fields["preview_interval"] = _int_in("preview_interval", given["preview_interval"], 0, INT32_MAX)
    if "output_format" in given:
        fmt = _text("output_format", given["output_format"], 16).strip().lower()
        if fmt not in OUTPUT_FORMATS:
            raise InvalidInputError("output_format", f"{fmt!r} is not one of {', '.join(OUTPUT_FORMATS)}")
        fields["output_format"] = fmt

    params = SamplingParams(**fields)
    if adapter is not None:
        adapter.validate(params)
    return params


# -- outputs ------------------------------------------------------------------------


def encode_png_base64(images: np.ndarray) -> np.ndarray:
    """uint8 [N, H, W, 3] -> BYTES [N] of base64 PNG text.

    Base64 because Triton's HTTP generate endpoint writes BYTES outputs into JSON
    as-is, and raw PNG bytes are not valid UTF-8 (measured on 2.51); base64 text
    decodes the same way over gRPC and SSE.
    """
    from PIL import Image  # noqa: PLC0415 (only png requests pay the import)

    encoded = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG", compress_level=1)
        encoded.append(base64.b64encode(buffer.getvalue()))
    return np.array(encoded, dtype=np.object_)


def output_arrays(output: DiffusionOutput, output_format: str = "raw") -> dict[str, np.ndarray]:
    """The response tensors of one successful output (progress, preview or final).

    Always `step`, `num_steps`, `is_final`; with images also `image` (uint8
    [N, H, W, 3]), `video` ([N, F, H, W, 3]) or, for png, `image_png`.
    """
    assert output.error is None, "errors are sent as TritonError, not tensors"
    arrays = {
        "step": np.array([output.step], dtype=np.int32),
        "num_steps": np.array([output.num_steps], dtype=np.int32),
        "is_final": np.array([output.is_final], dtype=np.bool_),
    }
    images = output.images
    if images is not None:
        images = np.ascontiguousarray(images, dtype=np.uint8)
        if images.ndim == 5:
            arrays["video"] = images
        elif output_format == "png":
            arrays["image_png"] = encode_png_base64(images)
        else:
            arrays["image"] = images
    return arrays
