"""The Triton edge without Triton: request tensors -> validated params (and every rejection), outputs -> tensors.

Reading tensors checks datatypes and shapes (serving/tensors.py); everything else
is the one validation of the declaration (engine_lib/interface.py), which is
what these tests drive, with a schema of the common inputs under a small config.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from engine_lib import interface
from engine_lib.config import EngineConfig
from engine_lib.interface import InputSchema, InputSpec, OutputSpec
from engine_lib.request import DiffusionOutput, InvalidInputError, SamplingParams
from engine_lib.serving.sender import error_message
from engine_lib.serving.tensors import NUMPY_DTYPES, output_arrays, read_inputs

CONFIG = EngineConfig.from_parameters(dict(max_height="256", max_width="128", max_num_inference_steps="50",
                                           max_num_images="3", max_prompt="20", max_negative_prompt="20",
                                           default_height="32", default_width="48", default_num_inference_steps="5"))
GUIDANCE = InputSpec("guidance_scale", "FP32", "guidance", default=7.0, low=0, high=100)
TRUE_CFG = InputSpec("true_cfg_scale", "FP32", "true CFG", default=1.0, low=0, high=100)
SPECS = (interface.PROMPT, interface.NEGATIVE_PROMPT, interface.HEIGHT, interface.WIDTH,
         interface.NUM_INFERENCE_STEPS, interface.SEED, interface.NUM_IMAGES, interface.PREVIEW_INTERVAL,
         interface.output_format("png"), GUIDANCE, TRUE_CFG)
SPECS = interface.replace_spec(SPECS, "height", low=16, multiple_of=16)
SPECS = interface.replace_spec(SPECS, "width", low=16, multiple_of=16)
SCHEMA = InputSchema("fake", SPECS, CONFIG)


def tensor(name, value):
    if isinstance(value, str):
        value = value.encode()
    return np.array([value], dtype=NUMPY_DTYPES[SCHEMA.specs[name].datatype][0])


def parse(**values):
    return SCHEMA.parse(read_inputs({name: tensor(name, v) for name, v in values.items()}, SCHEMA.specs))


def test_defaults_come_from_the_config_and_the_declaration():
    params = parse(prompt="a cat")
    assert params == SamplingParams(prompt="a cat", negative_prompt=None, height=32, width=48, num_inference_steps=5,
                                    seed=params.seed, num_images=1, preview_interval=0, output_format="raw",
                                    guidance_scale=7.0, true_cfg_scale=1.0)


def test_a_left_out_seed_is_random():
    assert len({parse(prompt="a cat").seed for _ in range(5)}) > 1


def test_sent_values_replace_the_defaults():
    assert parse(prompt="x", guidance_scale=2.0).guidance_scale == 2.0


def test_inputs_the_pipeline_does_not_declare_are_refused():
    with pytest.raises(InvalidInputError, match="'strength': fake does not use this input"):
        SCHEMA.parse({"prompt": "x", "strength": 0.5})


def test_an_input_the_checkpoint_does_not_use_is_refused_with_the_reason():
    schema = InputSchema("fake", interface.replace_spec(SPECS, "guidance_scale", unused="not distilled"), CONFIG)
    assert schema.parse({"prompt": "x"}).guidance_scale is None
    with pytest.raises(InvalidInputError, match="'guidance_scale': fake does not use this input: not distilled"):
        schema.parse({"prompt": "x", "guidance_scale": 3.0})


def test_the_adapters_check_runs_last():
    def check(params):
        if params.guidance_scale > 5 and params.negative_prompt is None:
            raise InvalidInputError("negative_prompt", "is needed above guidance 5")

    schema = InputSchema("fake", SPECS, CONFIG, check=check)
    with pytest.raises(InvalidInputError, match="'negative_prompt'"):
        schema.parse({"prompt": "x"})
    assert schema.parse({"prompt": "x", "guidance_scale": 2.0}).guidance_scale == 2.0


def test_every_input_parsed():
    params = parse(prompt="a cat", negative_prompt="", height=64, width=128, num_inference_steps=50,
                   guidance_scale=0.0, true_cfg_scale=4.5, seed=2**40, num_images=3, preview_interval=2,
                   output_format="png")
    assert params == SamplingParams(prompt="a cat", negative_prompt="", height=64, width=128,
                                    num_inference_steps=50, guidance_scale=0.0, true_cfg_scale=4.5, seed=2**40,
                                    num_images=3, preview_interval=2, output_format="png")
    assert type(params.height) is int and type(params.guidance_scale) is float and type(params.seed) is int


@pytest.mark.parametrize("decimal", [0.1, 0.2, 0.3, 0.6, 0.7, 0.8, 4.3, 23.976, 99.9])
def test_an_fp32_input_reads_as_the_decimal_sent(decimal):
    """Triton hands a float over as FP32 (0.6 as 0.6000000238): it reads back as the Python float the client
    wrote, so what is counted from it is what diffusers counts from the decimal (strength 0.6 of 5 steps:
    int(5 - 5 x 0.6) = 2 skipped, where the FP32 value would skip 1)."""
    assert float(np.float32(decimal)) != decimal  # not exactly representable: the FP32 value differs
    value = parse(prompt="x", guidance_scale=decimal).guidance_scale
    assert type(value) is float and value == decimal
    assert int(5 - 5 * value) == int(5 - 5 * decimal)


@pytest.mark.parametrize("sent", ["PNG", " png", "png\n", "Png"])
def test_a_choice_is_taken_only_as_written(sent):
    """Choices are strict: another spelling of an allowed value is refused, listing the allowed values as
    written (a folded value would be a second name of one choice, compared as written by the clients' logs)."""
    with pytest.raises(InvalidInputError) as info:
        parse(prompt="x", output_format=sent)
    assert info.value.input_name == "output_format" and "is not one of: raw, png (exactly, lower case)" in str(info.value)
    assert parse(prompt="x", output_format="png").output_format == "png"


def test_a_setting_that_changes_nothing_is_refused_naming_it():
    """An input declared `only_with` another input's values is refused when sent without them, not ignored;
    left out, or with them (sent, or as the deployment's default), it is taken."""
    mode = InputSpec("mode", "BYTES", "a method", choices=("none", "fast"), high=8)
    knob = InputSpec("knob", "FP32", "the fast method's knob", low=0, high=1, only_with=("mode", ("fast",)))
    schema = InputSchema("fake", (interface.PROMPT, mode, knob), CONFIG)
    for values, says in (({"knob": 0.3}, "it is None"), ({"knob": 0.3, "mode": "none"}, "it is 'none'")):
        with pytest.raises(InvalidInputError) as info:
            schema.parse({"prompt": "x", **values})
        assert info.value.input_name == "knob" and "changes nothing unless mode is fast" in str(info.value) and \
            says in str(info.value)
    assert schema.parse({"prompt": "x", "mode": "fast", "knob": 0.3}).knob == 0.3
    assert schema.parse({"prompt": "x", "mode": "none"}).knob is None
    defaulted = InputSchema("fake", (interface.PROMPT, mode, knob), EngineConfig.from_parameters({"default_mode": "fast"}))
    assert defaulted.parse({"prompt": "x", "knob": 0.3}).knob == 0.3


def test_none_means_not_sent():
    assert SCHEMA.parse(read_inputs({"prompt": tensor("prompt", "x"), "height": None}, SCHEMA.specs)).height == 32


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
    (dict(prompt="ok", true_cfg_scale=-0.5), "true_cfg_scale", "in [0, 100]"),
    (dict(prompt="ok", guidance_scale=1e38), "guidance_scale", "in [0, 100]"),
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


@pytest.mark.parametrize("values, name, fragment", [
    (dict(height=64.0), "height", "not an integer"),
    (dict(height=True), "height", "not an integer"),
    (dict(height="64"), "height", "not an integer"),
    (dict(guidance_scale="2"), "guidance_scale", "not a number"),
    (dict(negative_prompt=3), "negative_prompt", "must be text"),
    (dict(seed=2**63), "seed", "[0, "),
    (dict(height=2**40), "height", "[16, 256]"),  # no INT32 wrap in-process
    (dict(height=[64]), "height", "not an integer"),
    (dict(height={"value": 64}), "height", "not an integer"),
    (dict(negative_prompt=["a", "b"]), "negative_prompt", "must be text"),
    (dict(negative_prompt=b"\xff"), "negative_prompt", "UTF-8"),
    (dict(output_format="x" * 10_000), "output_format", "at most 16"),
])
def test_in_process_values_of_the_wrong_type_are_refused(values, name, fragment):
    with pytest.raises(InvalidInputError) as info:
        SCHEMA.parse({"prompt": "ok", **values})
    assert info.value.input_name == name and fragment in str(info.value)


def test_missing_prompt():
    with pytest.raises(InvalidInputError, match="input 'prompt': is required"):
        SCHEMA.parse(read_inputs({"height": tensor("height", 32)}, SCHEMA.specs))


def test_prompt_not_utf8():
    with pytest.raises(InvalidInputError, match="input 'prompt': must be UTF-8"):
        SCHEMA.parse(read_inputs({"prompt": np.array([b"\xff\xfe"], dtype=np.object_)}, SCHEMA.specs))


@pytest.mark.parametrize("name, array, fragment", [
    ("height", np.array([32.0], dtype=np.float32), "datatype must be INT32"),
    ("seed", np.array([1], dtype=np.int32), "datatype must be INT64"),
    ("prompt", np.array([1], dtype=np.int32), "datatype must be BYTES"),
    ("height", np.array([32, 32], dtype=np.int32), "shape must be [1]"),
    ("height", np.array([[32]], dtype=np.int32), "shape must be [1]"),
])
def test_wrong_datatype_or_shape(name, array, fragment):
    with pytest.raises(InvalidInputError) as info:
        read_inputs({"prompt": tensor("prompt", "ok"), name: array}, SCHEMA.specs)
    assert info.value.input_name == name and fragment in str(info.value)


def test_request_parameters_never_become_inputs():
    """Only `priority_key` is read; a declared input sent as a parameter and an unknown one are refused by name."""
    from engine_lib.serving.parameters import read_parameters

    assert read_parameters("{}", SCHEMA) == {} and read_parameters("", SCHEMA) == {}
    assert read_parameters("not json", SCHEMA) == {} and read_parameters("[1, 2]", SCHEMA) == {}
    assert read_parameters('{"priority_key": "k"}', SCHEMA) == {"priority_key": "k"}
    with pytest.raises(InvalidInputError, match="input 'heigth': fake does not use this input .did you mean 'height'"):
        read_parameters('{"heigth": 64, "nested": {"a": [1, 2]}}', SCHEMA)
    with pytest.raises(InvalidInputError, match="input 'prompt': must be sent as a tensor, not a request parameter"):
        read_parameters('{"prompt": "x"}', SCHEMA)


@pytest.mark.parametrize("priority, sent, key, allowed", [
    (0, None, "", True), (2, None, "", True), (3, None, "", True),  # the default and below: open to all
    (1, None, "k", False), (1, "wrong", "k", False), (1, 1, "k", False), (1, "k", "k", True),
    (1, "", "", False), (1, "anything", "", False),  # no key set: nobody passes the default
])
def test_a_level_above_the_default_needs_the_priority_key(priority, sent, key, allowed):
    from engine_lib.serving.parameters import check_priority

    if allowed:
        check_priority(priority, 2, 3, sent, key)
        return
    with pytest.raises(InvalidInputError, match=r"input 'priority': 1 is more urgent .* send 0 or a level in \[2, 3\]"):
        check_priority(priority, 2, 3, sent, key)


def test_unknown_tensor_is_refused_by_the_validation():
    values = read_inputs({"prompt": tensor("prompt", "ok"), "strength": np.array([0.5], dtype=np.float32)},
                         SCHEMA.specs)
    with pytest.raises(InvalidInputError, match="input 'strength': fake does not use this input"):
        SCHEMA.parse(values)


IMAGE = OutputSpec("image", "UINT8", (-1, -1, -1, 3), "images", encodings=("png",), pipe_output="images")


def test_outputs_progress_only():
    arrays = output_arrays(DiffusionOutput("r", step=2, num_steps=5, is_final=False))
    assert set(arrays) == {"step", "num_steps", "is_final"}
    assert arrays["step"].dtype == np.int32 and arrays["step"].tolist() == [2]
    assert arrays["is_final"].dtype == np.bool_ and arrays["is_final"].tolist() == [False]


def test_outputs_raw_image():
    images = np.random.default_rng(0).integers(0, 256, (2, 16, 32, 3), dtype=np.uint8)
    arrays = output_arrays(DiffusionOutput("r", 5, 5, True, outputs={"image": images}), "raw", {"image": IMAGE})
    assert arrays["image"].dtype == np.uint8 and arrays["image"].shape == (2, 16, 32, 3)
    np.testing.assert_array_equal(arrays["image"], images)
    assert arrays["is_final"].tolist() == [True]


def test_outputs_png_round_trip():
    images = np.random.default_rng(1).integers(0, 256, (2, 16, 32, 3), dtype=np.uint8)
    arrays = output_arrays(DiffusionOutput("r", 5, 5, True, outputs={"image": images}), "png", {"image": IMAGE})
    assert "image" not in arrays and arrays["image_png"].shape == (2,)
    for encoded, expected in zip(arrays["image_png"], images):
        decoded = np.asarray(Image.open(io.BytesIO(base64.b64decode(encoded))))
        np.testing.assert_array_equal(decoded, expected)  # PNG is lossless


def test_outputs_are_named_by_the_declaration_and_encoded_only_where_declared():
    video = np.zeros((1, 3, 16, 16, 3), dtype=np.uint8)
    audio = np.zeros((1, 2, 100), dtype=np.float32)
    declared = {"video": OutputSpec("video", "UINT8", (-1, -1, -1, -1, 3), "frames"),
                "audio": OutputSpec("audio", "FP32", (-1, -1, -1), "audio")}
    arrays = output_arrays(DiffusionOutput("r", 1, 1, True, outputs={"video": video, "audio": audio}), "png", declared)
    assert arrays["video"].shape == (1, 3, 16, 16, 3) and arrays["audio"].dtype == np.float32
    assert set(arrays) == {"video", "audio", "step", "num_steps", "is_final"}  # png: nothing declares it here


def test_declared_outputs_convert_floats_as_diffusers_rounds_them():
    floats = np.array([0.0, 0.4999, 0.5, 1.0, 1.2, -0.1], dtype=np.float32)
    np.testing.assert_array_equal(IMAGE.convert(floats), [0, 127, 128, 255, 255, 0])
    assert OutputSpec("audio", "FP32", (-1,), "audio").convert(np.array([0.5], dtype=np.float64)).dtype == np.float32


def test_error_messages_lead_with_code_and_request_id():
    error = InvalidInputError("height", "33 is bad")
    assert error_message(error, "r1") == ("INVALID_ARG", "INVALID_ARG: [request id: r1] input 'height': 33 is bad")
    assert error_message(RuntimeError("boom")) == ("INTERNAL", "INTERNAL: boom")


INTERVAL = InputSpec("cfg_interval", "FP32", "an interval", default=(0.4, 1.0), low=0, high=1, count=2)


@pytest.mark.parametrize("array, says", [
    (np.array([0.4], dtype=np.float32), "shape must be [2], got [1]"),
    (np.array([0.1, 0.2, 0.3], dtype=np.float32), "shape must be [2], got [3]"),
    (np.array([[0.1, 0.2]], dtype=np.float32), "shape must be [2], got [1, 2]"),
    (np.array([0.1, 0.2], dtype=np.float64), "datatype must be FP32"),
    (np.array([0.1, 1.5], dtype=np.float32), "1.5 must be a finite number in [0, 1]"),
])
def test_a_count_input_takes_exactly_its_elements(array, says):
    schema = InputSchema("fake", (interface.PROMPT, INTERVAL), CONFIG)
    with pytest.raises(InvalidInputError, match="input 'cfg_interval'") as caught:
        schema.parse(read_inputs({"prompt": tensor("prompt", "a"), "cfg_interval": array}, schema.specs))
    assert says in str(caught.value)
    good = read_inputs({"prompt": tensor("prompt", "a"), "cfg_interval": np.array([0.25, 0.75], np.float32)},
                       schema.specs)
    assert schema.parse(good).cfg_interval == (0.25, 0.75)
    assert schema.parse({"prompt": "a"}).cfg_interval == (0.4, 1.0)


@pytest.mark.parametrize("value, says", [(0.4, "must be a list of 2 values"), ([0.4], "must be a list of 2 values"),
                                         ([0.4, "x"], "must be a finite number"), ([0.4, 1.0, 1.0], "list of 2")])
def test_the_front_door_reads_a_count_input_as_a_json_list(value, says):
    from engine_lib.serving.openai_api.gateway import InputType, to_tensor

    with pytest.raises(InvalidInputError, match="input 'cfg_interval'") as caught:
        to_tensor("cfg_interval", value, InputType("TYPE_FP32", 2))
    assert says in str(caught.value)
    np.testing.assert_array_equal(to_tensor("cfg_interval", [0.4, 1], InputType("TYPE_FP32", 2)),
                                  np.array([0.4, 1.0], np.float32))
    with pytest.raises(InvalidInputError, match="not list"):
        to_tensor("height", [64, 64], InputType("TYPE_INT32"))


def test_mp4_output_is_a_playable_video_at_its_frame_rate_with_its_sound():
    """`output_format=mp4`: each video as base64 H.264 mp4 in memory (PyAV), at the response's frame rate, with
    the response's audio muxed in as a track when there is one; odd sizes are padded to even."""
    import av

    from engine_lib.serving.mp4 import probe_mp4

    videos = np.random.default_rng(0).integers(0, 256, (2, 9, 15, 22, 3), dtype=np.uint8)
    audio = np.sin(np.linspace(0, 100, 2 * 2 * 4000, dtype=np.float32)).reshape(2, 2, 4000) * 0.5
    outputs = {"video": videos, "frame_rate": np.array([12.0], np.float32), "audio": audio,
               "audio_sample_rate": np.array([16000], np.int32)}
    specs = {"video": interface.VIDEO}
    arrays = output_arrays(DiffusionOutput("r", 4, 4, True, outputs=outputs), "mp4", specs)
    assert "video" not in arrays and arrays["video_mp4"].shape == (2,) and "audio" in arrays
    for item in arrays["video_mp4"]:
        data = base64.b64decode(item)
        assert probe_mp4(data) == {"frames": 9, "height": 16, "width": 22, "audio_streams": 1}
        with av.open(io.BytesIO(data)) as container:
            assert container.streams.video[0].average_rate == 12
            assert container.streams.audio[0].sample_rate == 16000 and container.streams.audio[0].channels == 2
    silent = output_arrays(DiffusionOutput("r", 4, 4, True, outputs={"video": videos[:1]}), "mp4", specs)
    assert probe_mp4(base64.b64decode(silent["video_mp4"][0]))["audio_streams"] == 0
