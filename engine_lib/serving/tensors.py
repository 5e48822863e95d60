"""Request tensors -> input values, and engine outputs -> response tensors, both by the adapter's declaration.

Pure numpy (plus PIL for PNG): importable and testable without Triton. Reading
checks what only the tensors say (each input's datatype and `[1]` (or `[count]`) shape); every
other rule is the one validation at admission (`InputSchema.parse`). Every
rejection is an InvalidInputError naming the input, so the Triton edge can
answer INVALID_ARG before anything is queued.
"""

from __future__ import annotations

import base64
import io
from typing import Any, Callable, Mapping, Optional

import numpy as np

from engine_lib.interface import InputSpec, OutputSpec
from engine_lib.request import DiffusionOutput, InvalidInputError

# The numpy dtypes that carry each Triton input datatype.
NUMPY_DTYPES = {"BYTES": (np.object_, np.bytes_), "INT32": (np.int32,), "INT64": (np.int64,), "FP32": (np.float32,),
                "BOOL": (np.bool_,)}


def read_inputs(arrays: Mapping[str, Optional[np.ndarray]], specs: Mapping[str, InputSpec]) -> dict[str, Any]:
    """Each sent input's value from its `[1]` tensor (None or absent: not sent); unknown names are kept
    for the validation to refuse by name."""
    values = {}
    for name, array in arrays.items():
        if array is None:
            continue
        spec = specs.get(name)
        values[name] = np.asarray(array) if spec is None else _value(spec, array)
    return values


def _value(spec: InputSpec, array: Any) -> Any:
    """The element of a [1] input of the right datatype as a Python value (a tuple for a [count] input)."""
    array = np.asarray(array)
    if array.dtype.type not in NUMPY_DTYPES[spec.datatype]:
        raise InvalidInputError(spec.name, f"datatype must be {spec.datatype}, got {array.dtype}")
    if spec.max_count:
        if array.ndim != 1 or not 1 <= len(array) <= spec.max_count:
            raise InvalidInputError(spec.name, f"shape must be [n] with n from 1 to {spec.max_count}, "
                                               f"got {list(array.shape)}")
    elif array.shape != (spec.count,):
        raise InvalidInputError(spec.name, f"shape must be [{spec.count}], got {list(array.shape)}")
    if spec.datatype == "FP32":
        values = [fp32_decimal(v) for v in array]
    else:
        values = [v.item() if isinstance(v, np.generic) and not isinstance(v, np.bytes_) else v for v in array]
    return tuple(values) if spec.max_count or spec.count > 1 else values[0]


def fp32_decimal(value: np.float32) -> float:
    """The shortest decimal that reads back as this FP32 value, as a Python float: the 0.6 a client sent, not the
    0.6000000238 its FP32 tensor holds. Every FP32 input is read through it, so an integer or a comparison made
    from one (strength x steps, a threshold, seconds x fps) comes out as diffusers makes it from the decimal."""
    return float(str(np.float32(value)))  # numpy prints a float32 as its shortest round-tripping decimal


# -- outputs ------------------------------------------------------------------------


def encode_png_base64(images: np.ndarray, outputs: Mapping[str, np.ndarray]) -> np.ndarray:
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


def encode_mp4_base64(videos: np.ndarray, outputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """uint8 [N, F, H, W, 3] -> BYTES [N] of base64 mp4, at the response's `frame_rate` (24 if none), with
    the response's `audio` [N, C, S] (at `audio_sample_rate`) muxed in when it has one."""
    from engine_lib.serving.mp4 import encode_mp4  # noqa: PLC0415

    rate = float(outputs["frame_rate"][0]) if "frame_rate" in outputs else 24.0
    audio, sample_rate = outputs.get("audio"), int(outputs["audio_sample_rate"][0]) if "audio_sample_rate" in outputs else 0
    encoded = [encode_mp4(video, rate, None if audio is None else audio[i], sample_rate) for i, video in enumerate(videos)]
    return np.array([base64.b64encode(data) for data in encoded], dtype=np.object_)


# output_format -> the encoder of a declared output that lists it in `encodings` (sent as `<name>_<format>`);
# it gets the array and the response's other arrays (frame rate, audio).
ENCODERS: dict[str, Callable[[np.ndarray, Mapping[str, np.ndarray]], np.ndarray]] = {
    "png": encode_png_base64, "mp4": encode_mp4_base64}

def output_arrays(output: DiffusionOutput, output_format: str = "raw",
                  outputs: Optional[Mapping[str, OutputSpec]] = None) -> dict[str, np.ndarray]:
    """The response tensors of one successful output (progress, preview or final).

    Always `step`, `num_steps`, `is_final`; then each named array, as its declared
    output, or encoded as `<name>_<format>` when `output_format` is one of its encodings.
    """
    assert output.error is None, "errors are sent as TritonError, not tensors"
    arrays = {
        "step": np.array([output.step], dtype=np.int32),
        "num_steps": np.array([output.num_steps], dtype=np.int32),
        "is_final": np.array([output.is_final], dtype=np.bool_),
    }
    for name, array in output.outputs.items():
        spec = (outputs or {}).get(name)
        if spec is not None and output_format in spec.encodings:
            arrays[f"{name}_{output_format}"] = ENCODERS[output_format](array, output.outputs)
        else:
            arrays[name] = np.ascontiguousarray(array)
    return arrays
