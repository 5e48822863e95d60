"""The SD3 adapter against `StableDiffusion3Pipeline.__call__`, on the tiny random-weight pipeline (CPU, float32).

Solo runs (request mode and step mode) must be bitwise what diffusers gives;
batched runs may differ only by batch-size dependent CPU kernels (FLOAT_BOUND).
The shared suite (parity_checks.FlowMatchParitySuite) runs here; this module
adds what is SD3's own: CFG from `guidance_scale`, negative prompts, and its keys.
"""

from __future__ import annotations

import dataclasses

import pytest

from engine_lib.pipelines.flow_match import to_uint8
from engine_lib.pipelines.registry import get_adapter_class
from engine_lib.pipelines.sd3 import DEFAULT_GUIDANCE_SCALE, SD3Adapter
from engine_lib.request import InvalidInputError
from engine_lib.sched.keys import step_batch_key
from parity_checks import (PROMPTS, Arrival, FlowMatchParitySuite, assert_close_images, drive_steps, image_diff,
                           load_tiny_adapter, make_reference)

TEXT_LENGTH = 32  # T5 tokens after CLIP's 77 (diffusers' default, 256, runs in one test)


@pytest.fixture(scope="module")
def adapter() -> SD3Adapter:
    return load_tiny_adapter("sd3", SD3Adapter)


@pytest.fixture(scope="module")
def bitwise_adapter(adapter) -> SD3Adapter:
    """cfg_batching on is diffusers' own CFG: one forward of 2B rows, negatives first."""
    return adapter


@pytest.fixture(scope="module")
def reference(adapter):
    return make_reference(adapter, ("negative_prompt", "guidance_scale", "max_sequence_length"))


class TestSD3Parity(FlowMatchParitySuite):
    BASE = dict(max_sequence_length=TEXT_LENGTH)
    NO_CFG = dict(guidance_scale=1.0)
    CFG = dict(guidance_scale=5.0, negative_prompt="bad quality, blurry")


params = TestSD3Parity.params


def test_cfg_without_a_negative_prompt_uses_the_empty_one(adapter, reference):
    """guidance_scale unset is diffusers' 7.0 (CFG on); no negative prompt is diffusers' ""."""
    p = dataclasses.replace(params(steps=3, seed=4), guidance_scale=None)
    assert adapter.do_cfg(p) and adapter.cfg_scale(p) == DEFAULT_GUIDANCE_SCALE
    arrivals = [Arrival(0, "default", p),
                Arrival(1, "empty", dataclasses.replace(p, negative_prompt="", guidance_scale=7.0, seed=5)),
                Arrival(1, "negative", dataclasses.replace(p, negative_prompt="blurry", guidance_scale=7.0, seed=4))]
    result = drive_steps(adapter, arrivals, float_output=True)
    assert max(result.batch_sizes) == 3  # with and without a negative prompt in one CFG forward
    for a in arrivals:
        assert_close_images(result.images[a.request_id], reference(a.params), to_uint8)
    assert image_diff(result.images["default"], result.images["negative"]) > 1e-3  # the negative prompt matters


def test_keys_hold_text_length_and_cfg(adapter):
    def key(p):
        return step_batch_key(p, adapter.key_fields(p))

    base = params(guidance_scale=5.0)
    assert adapter.key_fields(base) == (("text_length", TEXT_LENGTH), ("cfg", True), ("cfg_scale", 5.0))
    assert key(base) != key(dataclasses.replace(base, max_sequence_length=None))  # 77 + 32 vs 77 + 256 tokens
    assert key(base) != key(dataclasses.replace(base, guidance_scale=4.0))  # the scale
    assert key(base) != key(dataclasses.replace(base, guidance_scale=1.0))  # CFG off
    assert adapter.key_fields(dataclasses.replace(base, guidance_scale=None))[1:] == (("cfg", True), ("cfg_scale", 7.0))
    # CFG off: the (unused) scale and negative prompt do not split batches; seeds and prompts never do.
    off = params(guidance_scale=1.0)
    assert adapter.key_fields(off)[1:] == (("cfg", False), ("cfg_scale", None))
    assert key(base) == key(params(PROMPTS[3], guidance_scale=5.0, seed=8, steps=9, negative_prompt="x"))


def test_validate_knows_the_largest_size(adapter):
    assert adapter.size_multiple == 8 and adapter.max_size == 64 * 8
    adapter.validate(params(height=512, width=8))
    with pytest.raises(InvalidInputError) as info:
        adapter.validate(params(width=520))
    assert info.value.input_name == "width" and "512" in str(info.value)


def test_registry_and_flags():
    assert get_adapter_class("sd3") is SD3Adapter
    assert SD3Adapter.supports_request_batch and SD3Adapter.supports_step_execution and SD3Adapter.supports_previews
    assert SD3Adapter.cfg_kind == "cfg" and not SD3Adapter.per_row_guidance
    assert "true_cfg_scale" not in SD3Adapter.supported_inputs
