"""EngineConfig.from_parameters: strict parsing of Triton's string parameters, errors that name the parameter."""

from __future__ import annotations

import dataclasses

import pytest

from engine_lib import interface
from engine_lib.config import PARAMETERS, ConfigError, EngineConfig
from engine_lib.interface import InputSchema
from engine_lib.placement import for_instance

SHARED = (interface.PROMPT, interface.NEGATIVE_PROMPT, interface.HEIGHT, interface.WIDTH,
          interface.NUM_INFERENCE_STEPS, interface.SEED, interface.NUM_IMAGES)


def parse(**params) -> EngineConfig:
    return EngineConfig.from_parameters(params)


def test_no_parameters_gives_the_defaults():
    assert parse() == EngineConfig()


@pytest.mark.parametrize("text", ["false", "False", "FALSE", "0", "no", "off", " false "])
def test_bool_false_spellings(text):
    assert parse(step_execution="true", warmup=text).model.warmup is False


@pytest.mark.parametrize("text", ["true", "True", "1", "yes", "on"])
def test_bool_true_spellings(text):
    assert parse(step_execution=text).scheduler.step_execution is True


@pytest.mark.parametrize("text", ["flase", "", "2", "y", "enabled"])
def test_bool_typo_is_an_error_naming_the_parameter(text):
    with pytest.raises(ConfigError, match="'cfg_batching'"):
        parse(cfg_batching=text)


def test_triton_string_value_form_accepted():
    config = EngineConfig.from_parameters({
        "step_execution": {"string_value": "true"},
        "max_num_seqs": {"string_value": "4"},
        "request_batch_max_wait_ms": {"string_value": "2.5"},
        "device": {"string_value": "cpu"},
    })
    assert (config.scheduler.step_execution, config.scheduler.max_num_seqs, config.scheduler.request_batch_max_wait_ms,
            config.model.device) == (
        True, 4, 2.5, "cpu")


def test_triton_string_value_form_is_parsed_as_strictly():
    with pytest.raises(ConfigError, match="'warmup'"):
        EngineConfig.from_parameters({"warmup": {"string_value": "flase"}})


@pytest.mark.parametrize("text, value", [("1", 1), ("8", 8), (" 3 ", 3)])
def test_max_num_seqs_valid(text, value):
    assert parse(max_num_seqs=text).scheduler.max_num_seqs == value


@pytest.mark.parametrize("text", ["0", "-2", "1.5", "four", "", "true"])
def test_max_num_seqs_invalid(text):
    with pytest.raises(ConfigError, match="'max_num_seqs'"):
        parse(max_num_seqs=text)


@pytest.mark.parametrize("text, value", [("0", 0.0), ("0.5", 0.5), ("20", 20.0)])
def test_request_batch_max_wait_ms_valid(text, value):
    assert parse(request_batch_max_wait_ms=text).scheduler.request_batch_max_wait_ms == value


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "Infinity", "-1", "-0.1", "soon", ""])
def test_request_batch_max_wait_ms_invalid(text):
    with pytest.raises(ConfigError, match="'request_batch_max_wait_ms'"):
        parse(request_batch_max_wait_ms=text)


def test_unknown_parameter_rejected_and_named():
    with pytest.raises(ConfigError, match="'max_num_seq'") as info:
        parse(max_num_seq="2")
    assert "max_num_seqs" in str(info.value)  # the known names are listed


@pytest.mark.parametrize("name", ["max_queue", "max_num_seqs", "max_loras"])
def test_counts_must_be_positive_integers(name):
    with pytest.raises(ConfigError, match=f"'{name}'"):
        parse(**{name: "0"})
    with pytest.raises(ConfigError, match=f"'{name}'"):
        parse(**{name: "x"})
    assert parse(**{name: "7"}).parameter(name) == 7


@pytest.mark.parametrize("text", ["x", "-1", "inf", "nan"])
def test_an_input_limit_must_be_a_finite_number(text):
    with pytest.raises(ConfigError, match="'max_height'"):
        parse(max_height=text)


def test_input_limits_and_defaults_reach_the_declared_inputs():
    config = parse(max_height="256", max_num_inference_steps="50", default_width="48", max_prompt="20")
    specs = InputSchema("qwen_image", SHARED, config).specs
    assert (specs["height"].high, specs["num_inference_steps"].high, specs["width"].default) == (256, 50, 48)
    assert specs["prompt"].high == 20 and specs["width"].high == 1024  # the built-in limit stays
    assert config.limits.input_max["height"] == 256 and isinstance(config.limits.input_max["height"], int)


@pytest.mark.parametrize("params, message", [
    ({"max_heigth": "256"}, "'max_heigth': qwen_image has no input 'heigth'"),
    ({"default_seeds": "1"}, "'default_seeds': qwen_image has no input 'seeds'"),
    ({"max_height": "0"}, "'max_height': 0 is below the least allowed value 1"),
    ({"default_height": "2048"}, "'default_height': '2048' is not a valid height"),
    ({"default_height": "tall"}, "'default_height': 'tall' is not a valid height")])
def test_a_bad_input_limit_or_default_fails_the_load_naming_it(params, message):
    with pytest.raises(ConfigError, match=message):
        InputSchema("qwen_image", SHARED, parse(**params))


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:3"])
def test_device_valid(device):
    assert parse(device=device).model.device == device


@pytest.mark.parametrize("device", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda:-1", "tpu"])
def test_device_invalid(device):
    with pytest.raises(ConfigError, match="'device'"):
        parse(device=device)


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16", "float16"])
def test_dtype_valid(dtype):
    assert parse(dtype=dtype).model.dtype == dtype


def test_dtype_invalid():
    with pytest.raises(ConfigError, match="'dtype'"):
        parse(dtype="fp8")


def test_string_parameters_are_kept_as_text():
    config = parse(pipeline="flux", model_path="/models/flux-tiny")
    assert (config.model.pipeline, config.model.model_path) == ("flux", "/models/flux-tiny")


def test_the_config_is_its_groups_and_each_flat_parameter_lives_in_one():
    groups = dataclasses.fields(EngineConfig)
    assert len(groups) <= 12 and all(dataclasses.is_dataclass(group.default_factory) for group in groups)
    names = [f.name for group in groups for f in dataclasses.fields(group.default_factory)]
    assert len(names) == len(set(names)) == len(PARAMETERS) + 2  # + the per-input limits
    config = parse(max_num_seqs="3", sequence_parallel_size="2", lora_dir="/l", quantization="int8",
                   prompt_cache_mb="7", max_queue="9", dtype="float16", max_height="96")
    assert (config.scheduler.max_num_seqs, config.parallel.sequence_parallel_size, config.lora.lora_dir,
            config.levers.quantization, config.cache.prompt_cache_mb, config.limits.max_queue, config.model.dtype,
            config.limits.input_max["height"]) == (3, 2, "/l", "int8", 7, 9, "float16", 96)
    assert config == EngineConfig.of(max_num_seqs=3, sequence_parallel_size=2, lora_dir="/l", quantization="int8",
                                     prompt_cache_mb=7, max_queue=9, dtype="float16",
                                     input_max={**EngineConfig().limits.input_max, "height": 96})


def test_replace_refuses_an_unknown_name():
    with pytest.raises(ConfigError, match="unknown parameter 'max_num_seq'"):
        EngineConfig().replace(max_num_seq=2)


def test_config_is_frozen_and_replace_validates():
    config = parse(max_num_seqs="2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.scheduler.max_num_seqs = 3
    assert config.replace(max_num_seqs=4).scheduler.max_num_seqs == 4
    with pytest.raises(ConfigError, match="'max_num_seqs'"):
        config.replace(max_num_seqs=0)


# -- instance_group: each Triton model instance's engine on its own device ------------------------


@pytest.mark.parametrize("kind, device_id, device, expected", [
    ("GPU", "0", "auto", "cuda:0"),
    ("GPU", "7", "auto", "cuda:7"),  # gpus: [7], or the 8th GPU of `count` per GPU
    ("GPU", "3", "cuda", "cuda:3"),  # plain cuda agrees with any GPU
    ("GPU", "2", "cuda:2", "cuda:2"),
    ("CPU", "0", "auto", "cpu"),
    ("CPU", "0", "cpu", "cpu"),
    ("MODEL", "0", "auto", "auto"),  # KIND_MODEL: the device parameter decides
    ("MODEL", "0", "cuda:5", "cuda:5"),
    ("", "0", "cpu", "cpu"),  # no kind given: as KIND_MODEL
])
def test_instance_kind_places_the_engine(kind, device_id, device, expected):
    config = for_instance(EngineConfig.from_parameters({"device": device}), kind, device_id)
    assert config.model.device == expected


@pytest.mark.parametrize("kind, params, device, devices", [
    ("MODEL", {"devices": "cuda:2,cuda:3"}, "cuda:2", ["cuda:2", "cuda:3"]),  # the engine beside rank 0
    ("MODEL", {"devices": "cuda:2,cuda:3", "device": "cuda:0"}, "cuda:0", ["cuda:2", "cuda:3"]),
    ("MODEL", {}, "auto", []),  # cuda:0 and cuda:1 on a GPU host, else the CPU
    ("CPU", {}, "cpu", []),
    ("CPU", {"devices": "cpu,cpu"}, "cpu", ["cpu", "cpu"]),
])
def test_a_parallel_instance_takes_its_ranks_devices_from_kind_model_and_devices(kind, params, device, devices):
    config = for_instance(EngineConfig.from_parameters({"cfg_parallel": "true", **params}), kind, "1")
    assert (config.model.device, config.parallel.device_list()) == (device, devices)


@pytest.mark.parametrize("kind, params, message", [
    ("GPU", {}, r"KIND_GPU: this instance runs 2 ranks .* KIND_MODEL .* parameter 'devices'"),
    ("CPU", {"devices": "cuda:0,cuda:1"}, r"parameter 'devices': 'cuda:0,cuda:1' .* contradicts .* KIND_CPU"),
    ("CPU", {"device": "cuda"}, r"device 'cuda'\) contradicts .* KIND_CPU"),
])
def test_a_parallel_instance_on_kind_gpu_or_contradicting_kind_cpu_fails_the_load(kind, params, message):
    with pytest.raises(ConfigError, match=message):
        for_instance(EngineConfig.from_parameters({"tensor_parallel_size": "2", **params}), kind, "0")


@pytest.mark.parametrize("kind, device_id, device", [
    ("GPU", "1", "cpu"),
    ("GPU", "1", "cuda:0"),
    ("CPU", "0", "cuda"),
    ("CPU", "0", "cuda:1"),
])
def test_a_device_contradicting_the_instance_kind_fails_the_load(kind, device_id, device):
    with pytest.raises(ConfigError, match=rf"parameter 'device': '{device}' contradicts instance_group kind "
                                          rf"KIND_{kind}"):
        for_instance(EngineConfig.from_parameters({"device": device}), kind, device_id)
