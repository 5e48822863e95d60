"""The SD3 adapter against `StableDiffusion3Pipeline.__call__`, on the tiny random-weight pipeline (CPU, float32).

Solo runs (request mode and step mode) must be bitwise what diffusers gives;
batched runs may differ only by batch-size dependent CPU kernels (FLOAT_BOUND).
The shared suite (parity_checks.FlowMatchParitySuite) runs here; this module
adds what is SD3's own: CFG from `guidance_scale`, negative prompts, and its keys.
"""

from __future__ import annotations

import pytest
import torch

from engine_lib.interface import to_uint8
from engine_lib.pipelines.registry import get_adapter_class
from engine_lib.pipelines.sd3.adapter import DEFAULT_GUIDANCE_SCALE, SD3Adapter
from engine_lib.pipelines.sd3.mixed_sizes import SD3Packing, packed_forward
from engine_lib.pipelines.sd3.tokens import from_tokens, to_tokens
from engine_lib.request import InvalidInputError
from tests.helpers.parity_checks import (PROMPTS, Arrival, FlowMatchParitySuite, assert_close_images, image_diff,
                                         load_tiny_adapter, parse, pipe_reference, run_steps)

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
    return pipe_reference(adapter)


class TestSD3Parity(FlowMatchParitySuite):
    BASE = dict(max_sequence_length=TEXT_LENGTH)
    NO_CFG = dict(guidance_scale=1.0)
    CFG = dict(guidance_scale=5.0, negative_prompt="bad quality, blurry")


params = TestSD3Parity.params


def test_cfg_without_a_negative_prompt_uses_the_empty_one(adapter, reference):
    """guidance_scale unset is diffusers' 7.0 (CFG on); no negative prompt is diffusers' ""."""
    p = {k: v for k, v in params(steps=3, seed=4).items() if k != "guidance_scale"}
    parsed = parse(adapter, p)
    assert adapter.do_cfg(parsed) and adapter.cfg_scale(parsed) == DEFAULT_GUIDANCE_SCALE
    arrivals = [Arrival(0, "default", p),
                Arrival(1, "empty", {**p, "negative_prompt": "", "guidance_scale": 7.0, "seed": 5}),
                Arrival(1, "negative", {**p, "negative_prompt": "blurry", "guidance_scale": 7.0, "seed": 4})]
    result = run_steps(adapter, arrivals, float_output=True)
    assert max(result.forward_sizes) == 3  # with and without a negative prompt in one CFG forward
    for a in arrivals:
        assert_close_images(result.images[a.request_id], reference(a.params), to_uint8)
    assert image_diff(result.images["default"], result.images["negative"]) > 1e-3  # the negative prompt matters


def test_keys_hold_text_length_and_cfg(adapter):
    def key(inputs):
        return adapter.step_key(parse(adapter, inputs))

    base = params(guidance_scale=5.0)
    assert adapter.key_fields(parse(adapter, base)) == (("cfg", True), ("cfg_scale", 5.0), ("text_length", TEXT_LENGTH))
    assert key(base) != key({**base, "max_sequence_length": 256})  # 77 + 32 vs 77 + 256 tokens
    assert key(base) != key({**base, "guidance_scale": 4.0})  # the scale
    assert key(base) != key({**base, "guidance_scale": 1.0})  # CFG off
    default = {k: v for k, v in base.items() if k != "guidance_scale"}
    assert adapter.key_fields(parse(adapter, default))[:2] == (("cfg", True), ("cfg_scale", 7.0))
    # CFG off: the (unused) scale and negative prompt do not split batches; seeds and prompts never do.
    off = params(guidance_scale=1.0)
    assert adapter.key_fields(parse(adapter, off))[:2] == (("cfg", False), ("cfg_scale", None))
    assert key(off) == key(params(guidance_scale=0.5, negative_prompt="x"))
    assert key(base) == key(params(PROMPTS[3], guidance_scale=5.0, seed=8, steps=9, negative_prompt="x"))


def test_validation_knows_the_largest_size(adapter):
    assert adapter.size_multiple == 8 and adapter.max_size == 64 * 8
    parse(adapter, params(height=512, width=8))
    with pytest.raises(InvalidInputError) as info:
        parse(adapter, params(width=520))
    assert info.value.input_name == "width" and "512" in str(info.value)


def test_registry_and_flags():
    assert get_adapter_class("sd3") is SD3Adapter
    runs = SD3Adapter.capabilities.supports
    assert runs("request_batch") and runs("step_execution") and runs("previews")
    assert SD3Adapter.cfg_kind == "cfg" and SD3Adapter.input_spec("guidance_scale").batch == "adapter"
    assert "true_cfg_scale" not in {s.name for s in SD3Adapter.inputs}


@pytest.mark.parametrize("variant", ["sd3", "sd3.5"])
def test_packed_forward_gives_each_row_what_its_own_forward_gives(adapter, variant):
    """The packed forward over rows whose patch counts repeat out of row order (several attention groups;
    4x8 and 8x4 share a count but not their crops of the position table), each with its own timestep, gives
    every row diffusers' forward of that row alone, and zeros on its padding: through the joint blocks and the
    last, `context_pre_only` one. SD3.5's layout (a second, image-only attention; RMS qk norms) too."""
    transformer = adapter.pipe.transformer
    if variant == "sd3.5":
        from diffusers import SD3Transformer2DModel

        transformer = SD3Transformer2DModel.from_config(
            {**transformer.config, "dual_attention_layers": (0,), "qk_norm": "rms_norm"}).eval()
        assert transformer.transformer_blocks[0].use_dual_attention and transformer.transformer_blocks[0].attn.norm_q
    sizes = [(8, 8), (4, 4), (4, 8), (8, 4), (8, 8)]  # latent pixels; patch 2
    longest, channels = max(h * w for h, w in sizes), transformer.config.in_channels
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(len(sizes), longest, channels, generator=gen)
    timestep = 1000 * torch.rand(len(sizes), generator=gen)
    text = torch.randn(len(sizes), 7, transformer.config.joint_attention_dim, generator=gen)
    pooled = torch.randn(len(sizes), transformer.config.pooled_projection_dim, generator=gen)
    packing = SD3Packing(sizes, transformer.config.patch_size, torch.device("cpu"))
    assert [group.rows for group in packing.groups] == [[0, 4], [1], [2, 3]]
    together = packed_forward(transformer, latents, timestep, pooled, text, packing)
    for row, (h, w) in enumerate(sizes):
        with torch.inference_mode():
            alone = transformer(hidden_states=from_tokens(latents[row:row + 1, :h * w], h, w),
                                timestep=timestep[row:row + 1], pooled_projections=pooled[row:row + 1],
                                encoder_hidden_states=text[row:row + 1], return_dict=False)[0]
        torch.testing.assert_close(together[row:row + 1, :h * w], to_tokens(alone), rtol=1e-4, atol=1e-5)
        assert not together[row, h * w:].any()
