"""tensors.py without Triton: request arrays -> SamplingParams (and every rejection), outputs -> arrays."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from engine_lib.config import EngineConfig
from engine_lib.request import DiffusionOutput, InvalidInputError, SamplingParams
from engine_lib.serving.sender import error_message
from engine_lib.serving.tensors import INPUT_SPECS, output_arrays, parse_inputs

CONFIG = EngineConfig(max_height=256, max_width=128, max_steps=50, max_num_images=3, max_prompt_chars=20,
                      default_height=32, default_width=48, default_steps=5)
DTYPES = {"BYTES": np.object_, "INT32": np.int32, "INT64": np.int64, "FP32": np.float32}


def tensor(name, value):
    if isinstance(value, str):
        value = value.encode()
    return np.array([value], dtype=DTYPES[INPUT_SPECS[name].datatype])


def parse(**values):
    return parse_inputs({name: tensor(name, v) for name, v in values.items()}, CONFIG, size_multiple=16)


def test_defaults_come_from_the_config_and_sampling_params():
    params = parse(prompt="a cat")
    assert params == SamplingParams(prompt="a cat", height=32, width=48, num_inference_steps=5, seed=params.seed)


def test_a_left_out_seed_is_random():
    assert len({parse(prompt="a cat").seed for _ in range(5)}) > 1


class FakeAdapter:
    """Only what parse_inputs reads from an adapter: its inputs, their defaults, and validate()."""

    name = "fake"
    supported_inputs = frozenset({"height", "width", "num_inference_steps", "seed", "guidance_scale"})
    default_inputs = {"guidance_scale": 7.0}

    def validate(self, params):
        pass


def test_pipeline_defaults_fill_left_out_inputs():
    params = parse_inputs({"prompt": tensor("prompt", "x")}, CONFIG, adapter=FakeAdapter())
    assert params.guidance_scale == 7.0
    sent = parse_inputs({"prompt": tensor("prompt", "x"), "guidance_scale": tensor("guidance_scale", 2.0)},
                        CONFIG, adapter=FakeAdapter())
    assert sent.guidance_scale == 2.0


def test_inputs_the_pipeline_does_not_use_are_refused():
    inputs = {"prompt": tensor("prompt", "x"), "negative_prompt": tensor("negative_prompt", "y")}
    with pytest.raises(InvalidInputError, match="'negative_prompt': fake does not use this input"):
        parse_inputs(inputs, CONFIG, adapter=FakeAdapter())


def test_every_input_parsed():
    params = parse(prompt="a cat", negative_prompt="", height=64, width=128, num_inference_steps=50,
                   guidance_scale=0.0, true_cfg_scale=4.5, seed=2**40, num_images=3, preview_interval=2,
                   output_format="PNG")
    assert params == SamplingParams(prompt="a cat", negative_prompt="", height=64, width=128,
                                    num_inference_steps=50, guidance_scale=0.0, true_cfg_scale=4.5, seed=2**40,
                                    num_images=3, preview_interval=2, output_format="png")


def test_none_means_not_sent():
    assert parse_inputs({"prompt": tensor("prompt", "x"), "height": None}, CONFIG).height == 32


@pytest.mark.parametrize("values, name, fragment", [
    (dict(prompt=""), "prompt", "empty"),
    (dict(prompt=" \n"), "prompt", "empty"),
    (dict(prompt="x" * 21), "prompt", "at most 20"),
    (dict(prompt="ok", negative_prompt="y" * 21), "negative_prompt", "at most 20"),
    (dict(prompt="ok", height=40), "height", "multiple of 16 in the range [16, 256]"),
    (dict(prompt="ok", height=0), "height", "[16, 256]"),
    (dict(prompt="ok", height=-16), "height", "[16, 256]"),
    (dict(prompt="ok", height=272), "height", "[16, 256]"),
    (dict(prompt="ok", width=144), "width", "[16, 128]"),
    (dict(prompt="ok", num_inference_steps=0), "num_inference_steps", "[1, 50]"),
    (dict(prompt="ok", num_inference_steps=51), "num_inference_steps", "[1, 50]"),
    (dict(prompt="ok", guidance_scale=float("nan")), "guidance_scale", "finite"),
    (dict(prompt="ok", guidance_scale=float("-inf")), "guidance_scale", "finite"),
    (dict(prompt="ok", true_cfg_scale=-0.5), "true_cfg_scale", ">= 0"),
    (dict(prompt="ok", true_cfg_scale=float("inf")), "true_cfg_scale", "finite"),
    (dict(prompt="ok", num_images=0), "num_images", "[1, 3]"),
    (dict(prompt="ok", num_images=4), "num_images", "[1, 3]"),
    (dict(prompt="ok", seed=-1), "seed", "[0, "),
    (dict(prompt="ok", preview_interval=-1), "preview_interval", "[0, "),
    (dict(prompt="ok", output_format="jpeg"), "output_format", "raw, png"),
])
def test_out_of_range_inputs_name_the_input_and_the_range(values, name, fragment):
    with pytest.raises(InvalidInputError) as info:
        parse(**values)
    assert info.value.input_name == name
    assert f"input '{name}'" in str(info.value) and fragment in str(info.value)


def test_missing_prompt():
    with pytest.raises(InvalidInputError, match="input 'prompt': is required"):
        parse_inputs({"height": tensor("height", 32)}, CONFIG)


def test_prompt_not_utf8():
    with pytest.raises(InvalidInputError, match="input 'prompt': must be UTF-8"):
        parse_inputs({"prompt": np.array([b"\xff\xfe"], dtype=np.object_)}, CONFIG)


@pytest.mark.parametrize("name, array, fragment", [
    ("height", np.array([32.0], dtype=np.float32), "datatype must be INT32"),
    ("seed", np.array([1], dtype=np.int32), "datatype must be INT64"),
    ("prompt", np.array([1], dtype=np.int32), "datatype must be BYTES"),
    ("height", np.array([32, 32], dtype=np.int32), "shape must be [1]"),
    ("height", np.array([[32]], dtype=np.int32), "shape must be [1]"),
])
def test_wrong_datatype_or_shape(name, array, fragment):
    inputs = {"prompt": tensor("prompt", "ok"), name: array}
    with pytest.raises(InvalidInputError) as info:
        parse_inputs(inputs, CONFIG)
    assert info.value.input_name == name and fragment in str(info.value)


def test_unknown_input_is_rejected():
    with pytest.raises(InvalidInputError, match="input 'strength': unknown input"):
        parse_inputs({"prompt": tensor("prompt", "ok"), "strength": np.array([0.5], dtype=np.float32)}, CONFIG)


def test_outputs_progress_only():
    arrays = output_arrays(DiffusionOutput("r", step=2, num_steps=5, is_final=False))
    assert set(arrays) == {"step", "num_steps", "is_final"}
    assert arrays["step"].dtype == np.int32 and arrays["step"].tolist() == [2]
    assert arrays["is_final"].dtype == np.bool_ and arrays["is_final"].tolist() == [False]


def test_outputs_raw_image():
    images = np.random.default_rng(0).integers(0, 256, (2, 16, 32, 3), dtype=np.uint8)
    arrays = output_arrays(DiffusionOutput("r", 5, 5, True, images=images))
    assert arrays["image"].dtype == np.uint8 and arrays["image"].shape == (2, 16, 32, 3)
    np.testing.assert_array_equal(arrays["image"], images)
    assert arrays["is_final"].tolist() == [True]


def test_outputs_png_round_trip():
    images = np.random.default_rng(1).integers(0, 256, (2, 16, 32, 3), dtype=np.uint8)
    arrays = output_arrays(DiffusionOutput("r", 5, 5, True, images=images), "png")
    assert "image" not in arrays and arrays["image_png"].shape == (2,)
    for encoded, expected in zip(arrays["image_png"], images):
        decoded = np.asarray(Image.open(io.BytesIO(base64.b64decode(encoded))))
        np.testing.assert_array_equal(decoded, expected)  # PNG is lossless


def test_outputs_video():
    video = np.zeros((1, 3, 16, 16, 3), dtype=np.uint8)
    assert output_arrays(DiffusionOutput("r", 1, 1, True, images=video))["video"].shape == (1, 3, 16, 16, 3)


def test_error_messages_lead_with_code_and_request_id():
    error = InvalidInputError("height", "33 is bad")
    assert error_message(error, "r1") == ("INVALID_ARG", "INVALID_ARG: [request id: r1] input 'height': 33 is bad")
    assert error_message(RuntimeError("boom")) == ("INTERNAL", "INTERNAL: boom")
