"""`max_request_cost`: one request's forward cost (latent tokens x rows, the adapter's `request_cost`) is bounded
at admission, by default 4x the cost of the pipeline's diffusers default request with CFG. No model: the
costs read only the checkpoint's compression ratios, here the real LTX-2's and Qwen-Image's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine_lib.config import ConfigError, EngineConfig
from engine_lib.engine import DiffusionEngine
from engine_lib.pipelines.flux.adapter import FluxAdapter
from engine_lib.pipelines.ltx2.adapter import LTX2Adapter
from engine_lib.pipelines.qwen_image.adapter import QwenImageAdapter
from engine_lib.request import InvalidInputError, SamplingParams


def modelless(cls, **pipe):
    instance = object.__new__(cls)
    instance.pipe = SimpleNamespace(**pipe)
    instance.device = "cpu"
    return instance


def ltx2():
    """LTX-2's real ratios: /32 in space, /8 in time; its audio at 16 kHz, hop 160, /4."""
    return modelless(LTX2Adapter, vae_spatial_compression_ratio=32, vae_temporal_compression_ratio=8,
                     audio_sampling_rate=16000, audio_hop_length=160, audio_vae_temporal_compression_ratio=4)


@pytest.fixture
def engine_of():
    engines = []

    def make(adapter, **parameters):
        config = EngineConfig.from_parameters({"pipeline": adapter.name, "warmup": "false",
                                               "step_execution": "true", **parameters})
        engines.append(DiffusionEngine(adapter, config))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


def video(height, width, num_frames):
    return {"prompt": "rain on a lake", "height": height, "width": width, "num_frames": num_frames}


def test_the_largest_ltx2_request_is_refused_by_default_naming_its_inputs(engine_of):
    engine = engine_of(ltx2())
    assert engine.max_request_cost == 4 * 16 * (16 * 24) * 2  # 512x768, 121 frames: 16 x 16 x 24 tokens, CFG
    with pytest.raises(InvalidInputError) as refused:
        engine.parse(video(1024, 1024, 257))
    assert refused.value.input_name == "num_frames"
    assert str(refused.value) == ("input 'num_frames': height x width x num_frames = 1024 x 1024 x 257 costs 67584 "
                                  "latent tokens x rows per forward, above this model's max_request_cost 49152")
    with pytest.raises(InvalidInputError, match="1024 x 1024 x 193 costs 51200 "):
        engine.parse(video(1024, 1024, 193))


@pytest.mark.parametrize("inputs", [video(512, 768, 121), video(1024, 1024, 185), video(512, 768, 257),
                                    video(64, 64, 17), {"prompt": "x"}])
def test_default_and_ordinary_ltx2_requests_are_admitted(engine_of, inputs):
    engine = engine_of(ltx2())
    assert engine.parse(inputs).prompt == inputs["prompt"]  # 1024x1024x185: exactly the limit


def test_max_request_cost_is_configurable_and_0_lifts_it(engine_of):
    assert engine_of(ltx2(), max_request_cost="0").parse(video(1024, 1024, 257)).num_frames == 257
    assert engine_of(ltx2(), max_request_cost="67584").parse(video(1024, 1024, 257)).num_frames == 257
    with pytest.raises(InvalidInputError, match="above this model's max_request_cost 6144$"):
        engine_of(ltx2(), max_request_cost="6144").parse(video(512, 768, 121))


@pytest.mark.parametrize("cls", [QwenImageAdapter, FluxAdapter])
def test_every_image_request_the_default_limits_allow_is_admitted(cls):
    adapter = modelless(cls, vae_scale_factor=8)
    largest = SamplingParams(height=1024, width=1024, num_images=4, negative_prompt="blur", true_cfg_scale=4.0,
                             guidance_scale=7.0)
    assert adapter.request_cost(largest) == adapter.default_max_request_cost() == 4 * 4096 * 2


@pytest.mark.parametrize("text, limit", [("auto", 123), ("0", 0), ("5000", 5000), (" 7 ", 7)])
def test_the_parameter_parses(text, limit):
    assert EngineConfig.from_parameters({"max_request_cost": text}).scheduler.request_cost_limit(123) == limit


@pytest.mark.parametrize("text", ["-1", "lots", "1e6", ""])
def test_a_bad_value_fails_the_load_naming_the_parameter(text):
    with pytest.raises(ConfigError, match="parameter 'max_request_cost': .* must be auto or an integer >= 0"):
        EngineConfig.from_parameters({"max_request_cost": text})
