"""What a pipeline declares about its interface: its inputs, its outputs, and the one validation.

An adapter lists `InputSpec`s and `OutputSpec`s (engine_lib/pipelines/). From
that declaration follow, with no per-pipeline code anywhere else:

* the input and output lists of `model_repository/<pipeline>/config.pbtxt`
  (`make repository`; a test fails when a checked-in config drifts);
* the one validation of every request, at admission (`InputSchema.parse`):
  unknown inputs, types, ranges, size multiples, defaults, and the adapter's
  checkpoint-specific rules, each error naming the input and what is allowed;
* which inputs split batches (`InputSpec.batch`, read by the compatibility keys);
* the mapping of named output arrays to Triton tensors (serving/tensors.py).

Torch-free, so the serving edge and the schedulers read it without a model.
"""

from __future__ import annotations

import difflib
import math
import numbers
import secrets
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from engine_lib.config import INPUT_DEFAULTS, INPUT_MAX, ConfigError
from engine_lib.request import InvalidInputError, SamplingParams

INT_RANGES = {"INT32": (-2**31, 2**31 - 1), "INT64": (-2**63, 2**63 - 1)}
# How an input's value shapes a batched forward (see sched/keys.py):
BATCH_ROLES = {
    "key": "requests share a forward only with equal values",
    "row": "each row carries its own value; never splits a batch",
    "steps": "the step count: splits request-mode waves, not step batches",
    "adapter": "the adapter's key_fields decide (e.g. a CFG scale matters only with CFG on)",
}


class _Random:
    """InputSpec.default for a fresh random value per request (seeds, as diffusers without a generator)."""

    def __repr__(self) -> str:
        return "random"


RANDOM = _Random()
SEED_RANGE = (0, 2**63 - 1)
# The largest guidance scale of every pipeline: diffusers' defaults are 1 to 10 (Flux 3.5, Qwen-Image 4, SD3 7,
# LTX-2 audio 7) and sweeps rarely pass 30, so 100 refuses no real use, while the guided prediction (at most ~100x
# the cond-uncond difference) stays finite even in float16. Without a bound 1e38 gave black images "successfully".
GUIDANCE_HIGH = 100.0


@dataclass(frozen=True)
class InputSpec:
    """One optional or required request input, as a `[1]` Triton tensor (`[count]`, or `[-1]` up to `max_count`).

    Text inputs (BYTES) count `low` as "must not be blank" (1) and `high` as the
    most characters; image inputs (BYTES, `content="image"`) are one encoded file, decoded
    and bounded by engine_lib/images.py into an `InputImage`; numbers are checked against `[low, high]` (inclusive) and,
    for integers, `multiple_of`. A model's config may lower `high` (`max_<input>`)
    and give an input without a declared default its default (`default_<input>`);
    `high_from` names an EngineConfig field that caps `high` (resolved by `InputSchema`).
    """

    name: str
    datatype: str  # Triton datatype: BYTES (UTF-8 text, or an encoded image), INT32, INT64, FP32, BOOL
    doc: str  # one line: what the input does (config.pbtxt comment and docs)
    default: Any = None  # a left-out input takes this (None: absent; RANDOM: a random seed)
    required: bool = False
    low: Optional[float] = None
    high: Optional[float] = None
    multiple_of: int = 1
    choices: tuple[str, ...] = ()  # text inputs: the allowed values, exactly as written (no case or space folding)
    high_from: str = ""
    batch: str = "key"
    pipe_arg: str = ""  # the diffusers `__call__` argument this input is ("" if none)
    low_note: str = ""  # why `low` is what it is; appended to the error of a value below it
    unused: str = ""  # set by a checkpoint that does not use a declared input: why (sending it is an error)
    count: int = 1  # elements of the [count] tensor; above 1 the value is a tuple (e.g. an interval)
    max_count: int = 0  # above 0: a [-1] tensor of 1 to max_count elements (several images), the value a tuple
    content: str = "text"  # BYTES only: "text" (UTF-8) or "image" (one PNG, JPEG or WebP file)
    # (input, its values): this input changes something only when that input (sent or defaulted) has one of
    # the values; sent otherwise, it is refused, never silently ignored (cache_threshold without the cache)
    only_with: tuple[str, tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        assert self.datatype in ("BYTES", "INT32", "INT64", "FP32", "BOOL"), f"{self.name}: datatype {self.datatype}"
        assert self.content == "text" or (self.content == "image" and self.datatype == "BYTES"), \
            f"{self.name}: content {self.content!r}"
        assert self.batch in BATCH_ROLES, f"{self.name}: batch role {self.batch!r}"
        # A float knob without bounds lets 1e38 through, and the image comes back black, counted a success.
        assert self.datatype != "FP32" or None not in (self.low, self.high), f"{self.name}: FP32 needs low and high"

    @property
    def triton_type(self) -> str:
        return "TYPE_STRING" if self.datatype == "BYTES" else f"TYPE_{self.datatype}"

    def check(self, value: Any) -> Any:
        """The value as its Python type, or InvalidInputError naming this input and what is allowed."""
        if self.max_count:
            if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, (Sequence, np.ndarray)):
                value = (value,)  # one value of a variable-count input
            if not 1 <= len(value) <= self.max_count:
                raise self._fail(f"{len(value)} values; 1 to {self.max_count} allowed")
            return tuple(replace(self, max_count=0).check(item) for item in value)
        if self.count > 1:
            if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)) or \
                    len(value) != self.count:
                raise self._fail(f"must be {self.count} values, got {value!r:.60}")
            return tuple(replace(self, count=1).check(item) for item in value)
        if self.content == "image":
            from engine_lib.images import decode_image  # noqa: PLC0415 (PIL only for image inputs)

            return decode_image(value, self.name)
        if self.datatype == "BYTES":
            return self._check_text(value)
        if self.datatype in INT_RANGES:
            return self._check_int(value)
        if self.datatype == "BOOL":
            if not isinstance(value, (bool, np.bool_)):
                raise self._fail(f"{value!r} is not true or false")
            return bool(value)
        return self._check_float(value)

    def _fail(self, message: str, below_low: bool = False) -> InvalidInputError:
        note = f" ({self.low_note})" if below_low and self.low_note else ""
        return InvalidInputError(self.name, message + note)

    def _check_text(self, value: Any) -> str:
        if isinstance(value, (bytes, np.bytes_)):
            try:
                value = bytes(value).decode("utf-8")
            except UnicodeDecodeError:
                raise self._fail("must be UTF-8 text") from None
        if not isinstance(value, str):
            raise self._fail(f"must be text, got {type(value).__name__}")
        if self.high is not None and len(value) > self.high:
            raise self._fail(f"{len(value)} characters; at most {int(self.high)} allowed")
        if self.low and not value.strip():
            raise self._fail("must not be empty")
        if self.choices and value not in self.choices:
            # strict: "PNG" or " png" would be a second spelling of a value that a client, a cache key or a
            # log line compares as written
            raise self._fail(f"{value!r} is not one of: {', '.join(self.choices)} (exactly, lower case)")
        return value

    def _check_int(self, value: Any) -> int:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise self._fail(f"{value!r} is not an integer")
        value = int(value)
        low, high = self._bounds()
        if self.multiple_of > 1:
            if not low <= value <= high or value % self.multiple_of:
                raise self._fail(f"{value} must be a multiple of {self.multiple_of} in the range [{low}, {high}]",
                                 value < low)
        elif not low <= value <= high:
            raise self._fail(f"{value} is outside the allowed range [{low}, {high}]", value < low)
        return value

    def _check_float(self, value: Any) -> float:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
            raise self._fail(f"{value!r} is not a number")
        value = float(value)
        low, high = self.low, self.high
        if not math.isfinite(value) or (low is not None and value < low) or (high is not None and value > high):
            if high is None:
                allowed = f">= {low:g}" if low is not None else ""
            else:
                allowed = f"in [{low:g}, {high:g}]" if low is not None else f"<= {high:g}"
            raise self._fail(f"{value} must be a finite number {allowed}".rstrip())
        return value

    def _bounds(self) -> tuple[int, int]:
        type_low, type_high = INT_RANGES[self.datatype]
        low = type_low if self.low is None else int(self.low)
        high = type_high if self.high is None else int(self.high)
        return low, high


@dataclass(frozen=True)
class OutputSpec:
    """One named output array of a final (or preview) response.

    `dims` are Triton's (-1: variable, the leading one is the output count);
    `encodings` are the `output_format` values that send it encoded instead, as
    the BYTES output `<name>_<format>` (e.g. `image_png`); `pipe_output` is the
    attribute of the diffusers pipeline's output this array is (`images`).
    """

    name: str
    datatype: str  # Triton datatype: UINT8 (from floats in [0, 1]), FP32, INT32, BYTES (text; BOOL: progress)
    dims: tuple[int, ...]
    doc: str
    encodings: tuple[str, ...] = ()
    pipe_output: str = ""

    @property
    def triton_type(self) -> str:
        return "TYPE_STRING" if self.datatype == "BYTES" else f"TYPE_{self.datatype}"

    def convert(self, array: Any) -> np.ndarray:
        """The pipeline's float output as this output's dtype (UINT8: diffusers' `numpy_to_pil` rounding)."""
        array = np.asarray(array)
        if self.datatype == "UINT8":
            return array if array.dtype == np.uint8 else to_uint8(array)
        if self.datatype == "BYTES":  # text, as UTF-8
            return np.array([v.encode("utf-8") if isinstance(v, str) else v for v in array.ravel()], dtype=np.object_)
        return array.astype({"FP32": np.float32, "INT32": np.int32}[self.datatype])


# Every response carries these, whatever the pipeline declares.
PROGRESS_OUTPUTS = (
    OutputSpec("step", "INT32", (1,), "denoising steps done"),
    OutputSpec("num_steps", "INT32", (1,), "denoising steps asked for"),
    OutputSpec("is_final", "BOOL", (1,), "true only on the last response"),
)


# What every video pipeline sends: the frames (mp4-encodable), and the rate they play at.
VIDEO = OutputSpec("video", "UINT8", (-1, -1, -1, -1, 3), "videos [N, F, H, W, 3] (chunk responses: that chunk's frames)",
                   encodings=("mp4",), pipe_output="frames")
FRAME_RATE = OutputSpec("frame_rate", "FP32", (1,), "frames per second the video plays at (and its mp4 is encoded at)")
FRAME_OFFSET = OutputSpec("frame_offset", "INT32", (1,), "chunk responses: the index of the chunk's first frame")
# The rate each video pipeline's frames play at (LTX-2: its frame_rate input's default), which the front door also
# needs, to turn a request's seconds into frames: Wan 2.2 and diffusers' Helios example export at 16 and 24 fps.
VIDEO_FRAME_RATES = {"ltx2": 24.0, "helios": 24.0, "wan": 16.0, "wan_i2v": 16.0}

# What a pipeline that writes text (BAGEL, HunyuanImage-3.0) sends besides its image.
TEXT = OutputSpec("text", "BYTES", (1,), "the answer or thought (UTF-8); intermediate responses: its new characters")
FINISH_REASON = OutputSpec("finish_reason", "BYTES", (1,), "with the whole text: stop (it ended on its end token) "
                           "or length (it reached max_new_tokens)")


def encoded_outputs(outputs: Sequence[OutputSpec]) -> tuple[OutputSpec, ...]:
    """The BYTES outputs that declared encodings add: `<name>_<format>` [N], base64 text of one file per item."""
    return tuple(OutputSpec(f"{spec.name}_{fmt}", "BYTES", (-1,), f"`{spec.name}` as base64 {fmt.upper()}, one per item")
                 for spec in outputs for fmt in spec.encodings)


def to_uint8(images: np.ndarray) -> np.ndarray:
    """Float images in [0, 1] to uint8, exactly as diffusers' `numpy_to_pil` (and every UINT8 output)."""
    return (np.clip(images, 0, 1) * 255).round().astype(np.uint8)


# -- the inputs every pipeline shares ----------------------------------------------------

PROMPT = InputSpec("prompt", "BYTES", "the text to generate from", required=True, low=1, batch="row", pipe_arg="prompt")
NEGATIVE_PROMPT = InputSpec("negative_prompt", "BYTES", "what to steer away from (classifier-free guidance)",
                            batch="adapter", pipe_arg="negative_prompt")
HEIGHT = InputSpec("height", "INT32", "image height in pixels", low=1, pipe_arg="height")
WIDTH = InputSpec("width", "INT32", "image width in pixels", low=1, pipe_arg="width")
NUM_INFERENCE_STEPS = InputSpec("num_inference_steps", "INT32", "denoising steps", low=1, batch="steps",
                                pipe_arg="num_inference_steps")
SEED = InputSpec("seed", "INT64", "random seed: the same seed and inputs give the same output", default=RANDOM,
                 low=SEED_RANGE[0], high=SEED_RANGE[1], batch="row")
NUM_IMAGES = InputSpec("num_images", "INT32", "images per prompt", default=1, low=1,
                       pipe_arg="num_images_per_prompt")
PREVIEW_INTERVAL = InputSpec("preview_interval", "INT32", "0: final response only; k: a preview every k steps",
                             default=0, low=0, high=INT_RANGES["INT32"][1], batch="row")

NUM_FRAMES = InputSpec("num_frames", "INT32", "video frames to generate", low=1,
                       pipe_arg="num_frames")

PRIORITY = InputSpec("priority", "INT32", "1: most urgent; larger: less urgent; 0: the model's default_priority_level",
                     default=0, low=0, high_from="priority_levels", batch="row")


def output_format(*encodings: str) -> InputSpec:
    """The `output_format` input: `raw` tensors, or one of the declared outputs' encodings."""
    return InputSpec("output_format", "BYTES", "raw: uint8 tensors; " + ", ".join(encodings) + ": encoded outputs",
                     default="raw", choices=("raw", *encodings), high=16, batch="row")


# -- one request's validation ---------------------------------------------------------------

Check = Callable[[SamplingParams], None]


class InputSchema:
    """A pipeline's declared inputs, resolved against one EngineConfig: the one place a request is validated.

    `parse(values)` takes the sent inputs by name (Python or numpy scalars; None
    means not sent) and returns complete SamplingParams: every declared input,
    left-out ones at their default. `check` is the adapter's hook for rules only
    the loaded checkpoint knows (e.g. guidance only on guidance-distilled models).
    """

    def __init__(self, pipeline: str, specs: Sequence[InputSpec], config: Any, check: Optional[Check] = None):
        self.pipeline = pipeline
        declared = {spec.name for spec in specs}
        for prefix, given in (("max", config.limits.input_max), ("default", config.limits.input_defaults)):
            # the built-in limits name inputs other pipelines declare; a deployer's typo is refused
            unknown = sorted(set(given) - declared - set(INPUT_MAX) - set(INPUT_DEFAULTS))
            if unknown:
                raise ConfigError(f"parameter '{prefix}_{unknown[0]}': {pipeline} has no input {unknown[0]!r} "
                                  f"(its inputs: {', '.join(sorted(declared))})")
        self.specs: dict[str, InputSpec] = {spec.name: _resolve(spec, config) for spec in specs}
        self._check = check

    def parse(self, values: Mapping[str, Any]) -> SamplingParams:
        unknown = sorted(name for name in values if name not in self.specs)
        if unknown:
            raise self.unknown(unknown[0])
        parsed = {}
        for name, spec in self.specs.items():
            value = values.get(name)
            if spec.unused:
                if value is not None:
                    raise InvalidInputError(name, f"{self.pipeline} does not use this input: {spec.unused}")
            elif value is None:
                if spec.required:
                    raise InvalidInputError(name, "is required")
                value = secrets.randbelow(2**31 - 1) if spec.default is RANDOM else spec.default
            else:
                value = spec.check(value)
            parsed[name] = value
        for name, spec in self.specs.items():
            if spec.only_with and values.get(name) is not None:
                other, allowed = spec.only_with
                if parsed.get(other) not in allowed:
                    raise InvalidInputError(name, f"changes nothing unless {other} is {' or '.join(allowed)} "
                                                  f"(it is {parsed.get(other)!r}): leave it out or set {other}")
        params = SamplingParams(parsed)
        if self._check is not None:
            self._check(params)
        return params

    def unknown(self, name: str) -> InvalidInputError:
        """The error for a name that is no input of this pipeline: the nearest input, and every one it uses."""
        uses = [name for name, spec in self.specs.items() if not spec.unused]
        near = difflib.get_close_matches(name, uses, n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        return InvalidInputError(name, f"{self.pipeline} does not use this input ({hint}it uses: {', '.join(uses)})")


def _resolve(spec: InputSpec, config: Any) -> InputSpec:
    """The spec under one config: its `max_<input>` (or `high_from` field) lowers `high`, its
    `default_<input>` is the default of an input that declares none (checked like a sent value)."""
    high = config.limits.input_max.get(spec.name)
    if spec.high_from:
        high = config.parameter(spec.high_from)
    if high is not None and spec.high is not None:
        high = min(spec.high, high)
    spec = spec if high is None else replace(spec, high=high)
    if spec.low is not None and spec.high is not None and spec.high < spec.low and spec.datatype != "BYTES":
        raise ConfigError(f"parameter 'max_{spec.name}': {spec.high} is below the least allowed value {spec.low}")
    text = config.limits.input_defaults.get(spec.name)
    if text is not None and spec.default is None:
        try:
            value = text if spec.datatype == "BYTES" else float(text) if spec.datatype == "FP32" else int(text)
            spec = replace(spec, default=spec.check(value))
        except (ValueError, InvalidInputError) as exc:
            raise ConfigError(f"parameter 'default_{spec.name}': {text!r} is not a valid {spec.name} ({exc})") from None
    return spec


def replace_spec(specs: Sequence[InputSpec], name: str, **changes: Any) -> tuple[InputSpec, ...]:
    """The specs with one of them changed (an adapter refining a shared input for its checkpoint)."""
    assert any(s.name == name for s in specs), f"no input {name!r}"
    return tuple(replace(s, **changes) if s.name == name else s for s in specs)
