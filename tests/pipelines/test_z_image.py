"""The Z-Image adapter against `ZImagePipeline.__call__`, on the tiny random-weight Z-Image-Turbo (CPU, float32).

Solo runs must be bitwise what diffusers gives; batched runs may differ only by batch-size dependent
CPU kernels and caption padding (FLOAT_BOUND). The shared suite runs here; this module adds what is
Z-Image's own: Turbo's schedule and defaults, CFG from any positive `guidance_scale`, and its keys.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_lib.config import EngineConfig
from engine_lib.interface import to_uint8
from engine_lib.pipelines.z_image.adapter import ZImageAdapter
from engine_lib.request import InvalidInputError
from tests.helpers.parity_checks import (PROMPTS, Arrival, FlowMatchParitySuite, assert_close_images, image_diff,
                                         load_tiny_adapter, parse, pipe_reference, run_steps, solo_steps)

TEXT_LENGTH = 64  # text tokens before the prompt's own are dropped (diffusers' default, 512, runs in one test)
REPOSITORY_CONFIG = Path(__file__).resolve().parents[2] / "model_repository" / "z_image" / "config.pbtxt"


@pytest.fixture(scope="module")
def adapter() -> ZImageAdapter:
    return load_tiny_adapter("z_image", ZImageAdapter)


@pytest.fixture(scope="module")
def bitwise_adapter(adapter) -> ZImageAdapter:
    """cfg_batching on is diffusers' own CFG: one forward of 2B rows, the prompts first."""
    return adapter


@pytest.fixture(scope="module")
def reference(adapter):
    return pipe_reference(adapter)


class TestZImageParity(FlowMatchParitySuite):
    BASE = dict(max_sequence_length=TEXT_LENGTH)
    SEEDS = (0, 1)  # two seeds x two step counts x CFG on and off are bitwise; a third seed adds time, not cases
    NO_CFG = dict(guidance_scale=0.0)
    CFG = dict(guidance_scale=0.6, negative_prompt="bad quality, blurry")
    PADS_TEXT = True  # captions keep only their own tokens: a longer one pads the others in a forward


params = TestZImageParity.params


def test_the_tiny_model_has_turbos_schedule(adapter):
    """Z-Image-Turbo's scheduler config (a fixed shift of 3): 8 steps give sigmas 3s / (1 + 2s) on
    linspace(1, 1/8, 8), whatever the image size, as diffusers sets them for Turbo."""
    config = adapter.pipe.scheduler.config
    assert (config.shift, config.use_dynamic_shifting) == (3.0, False)
    linear = torch.linspace(1.0, 1 / 8, 8, dtype=torch.float64)
    expected = 3 * linear / (1 + 2 * linear)
    for size in (32, 64):
        state = adapter.new_state("r", parse(adapter, params(steps=8, height=size, width=size)))
        adapter.prepare_encode(state)
        torch.testing.assert_close(state.scheduler.sigmas[:-1].double(), expected, rtol=0, atol=1e-6)
        assert float(state.scheduler.sigmas[-1]) == 0.0


def test_the_served_defaults_are_turbos_and_give_diffusers_turbo_call(adapter, reference):
    """model_repository/z_image sets Turbo's defaults (8 steps, guidance 0: diffusers' example for it): a request
    that leaves them out is `pipe(prompt, num_inference_steps=8, guidance_scale=0.0)`, bitwise."""
    pairs = re.findall(r'key: "(\w+)", value: \{ string_value: "([^"]*)" \}', REPOSITORY_CONFIG.read_text())
    config = EngineConfig.from_parameters(dict(pairs))
    defaults = adapter.input_schema(config).parse({"prompt": PROMPTS[1], "seed": 7, "height": 64, "width": 64})
    assert (defaults.num_inference_steps, defaults.guidance_scale) == (8, 0.0)
    assert not adapter.do_cfg(defaults)
    turbo = adapter.pipe(PROMPTS[1], height=64, width=64, num_inference_steps=8, guidance_scale=0.0,
                         generator=torch.Generator().manual_seed(7), output_type="np").images
    np.testing.assert_array_equal(solo_steps(adapter, defaults, float_output=True), turbo)


def test_any_positive_guidance_runs_cfg_and_enters_the_keys(adapter):
    def key(**kw):
        return adapter.step_key(parse(adapter, params(**kw)))

    assert not adapter.do_cfg(parse(adapter, params(guidance_scale=0.0)))
    assert adapter.do_cfg(parse(adapter, params(guidance_scale=0.3)))  # below 1 too: pos + 0.3 (pos - neg)
    assert key(guidance_scale=0.3) != key(guidance_scale=0.6) != key(guidance_scale=0.0)
    assert key(guidance_scale=0.0) == key(guidance_scale=0.0, negative_prompt="x", seed=9, steps=7)
    assert key(guidance_scale=0.6) == key(guidance_scale=0.6, max_sequence_length=32, prompt=PROMPTS[2])


def test_three_requests_joining_at_different_ticks_with_cfg_and_two_images(adapter, reference):
    """Three requests join at ticks 0, 1 and 3 (one with two images, captions of three lengths, the empty and a
    given negative prompt): each within 1 uint8 level of diffusers alone."""
    arrivals = [Arrival(0, "a", params(PROMPTS[0], cfg=True, steps=5, seed=1, num_images=2)),
                Arrival(1, "b", params(PROMPTS[2], cfg=True, steps=4, seed=2, negative_prompt="")),
                Arrival(3, "c", params(PROMPTS[3], cfg=True, steps=3, seed=3, max_sequence_length=32))]
    result = run_steps(adapter, arrivals, capacity=3, float_output=True)
    assert max(result.forward_sizes) == 3
    for a in arrivals:
        assert_close_images(result.images[a.request_id], reference(a.params), to_uint8)


def test_a_lora_on_every_layer_holds_rows_of_different_captions_in_one_forward(adapter, reference):
    """Z-Image's embedders see every row's tokens concatenated, so a forward holds one LoRA (in the keys) and
    applies it to all it sees: two requests of different caption lengths (one with two images) with the LoRA
    on every layer, the embedders too, share a forward and each stays within 1 level of its solo run, which is
    bitwise diffusers' with the LoRA set (tests/pipelines/test_lora.py)."""
    lora = dict(lora_name="toy_all", lora_scale=0.7)
    first = params(PROMPTS[0], steps=3, seed=1, num_images=2, **lora)
    second = params(PROMPTS[2], steps=3, seed=2, **lora)
    assert adapter.step_key(parse(adapter, first)) != adapter.step_key(parse(adapter, params(PROMPTS[0], steps=3)))
    together = run_steps(adapter, [Arrival(0, "first", first), Arrival(1, "second", second)], float_output=True)
    assert max(together.forward_sizes) == 2
    for name, p in (("first", first), ("second", second)):
        alone = solo_steps(adapter, p, float_output=True)
        assert_close_images(together.images[name], alone, to_uint8)
    assert image_diff(together.images["second"], reference(params(PROMPTS[2], steps=3, seed=2))) > 1e-2


def test_the_step_cache_is_refused_by_name(adapter):
    """diffusers' first-block cache does not run on Z-Image's transformer (docs/pipelines.md): no `cache` input."""
    with pytest.raises(InvalidInputError) as info:
        parse(adapter, params(cache="first_block"))
    assert info.value.input_name == "cache" and "does not use" in str(info.value)
