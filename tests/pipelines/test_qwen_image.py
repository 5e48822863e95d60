"""The Qwen-Image adapter against `QwenImagePipeline.__call__`, on the tiny random-weight pipeline (CPU, float32).

Solo runs (request mode and step mode) must be bitwise what diffusers gives;
batched runs may differ only by batch-size dependent CPU kernels (FLOAT_BOUND).
The shared suite (parity_checks.FlowMatchParitySuite) runs here; this module
adds what is Qwen-Image's own: its step minimum, its limits and flags, and the
registry's defaults (Qwen-Image is the default pipeline).
"""

from __future__ import annotations

import pytest
import torch

from engine_lib.config import EngineConfig
from engine_lib.pipelines import taylorseer
from engine_lib.pipelines.qwen_image.adapter import QwenImageAdapter
from engine_lib.pipelines.qwen_image.mixed_sizes import QwenPacking, packed_forward
from engine_lib.request import InvalidInputError
from tests.helpers.parity_checks import (FlowMatchParitySuite, load_tiny_adapter, packed_attention_on, parse,
                                         pipe_reference, with_cfg_batching)


@pytest.fixture(scope="module")
def adapter() -> QwenImageAdapter:
    return load_tiny_adapter("qwen_image", QwenImageAdapter)


@pytest.fixture(scope="module")
def bitwise_adapter(adapter) -> QwenImageAdapter:
    """cfg_batching off: QwenImagePipeline runs true CFG as two forwards of B rows."""
    return with_cfg_batching(adapter, False)


@pytest.fixture(scope="module")
def reference(adapter):
    return pipe_reference(adapter)


class TestQwenImageParity(FlowMatchParitySuite):
    CFG = dict(negative_prompt="bad quality, blurry", true_cfg_scale=4.0)
    STEPS = (4, 7)
    PADS_TEXT = True  # prompts keep their own token count; a batch pads to the longest


params = TestQwenImageParity.params


def test_a_single_step_is_rejected_for_its_nan_schedule(adapter):
    """The shared suite rejects 0 steps; Qwen-Image's shift_terminal schedule also needs 2."""
    parse(adapter, params(steps=2))
    with pytest.raises(InvalidInputError) as info:
        parse(adapter, {"prompt": "x", "num_inference_steps": 1})
    assert info.value.input_name == "num_inference_steps" and "NaN" in str(info.value)


def test_guidance_is_refused_by_a_checkpoint_that_is_not_guidance_distilled(adapter):
    assert parse(adapter, params()).guidance_scale is None
    with pytest.raises(InvalidInputError) as info:
        parse(adapter, params(guidance_scale=3.5))
    assert info.value.input_name == "guidance_scale" and "not guidance-distilled" in str(info.value)


def test_true_cfg_and_its_scale_enter_the_keys_only_with_a_negative_prompt(adapter):
    """true_cfg_scale > 1 without a negative prompt is no CFG (as diffusers); with CFG off the scale and the
    negative prompt's text never split a batch; prompts of any length share one (padded text)."""
    def key(**inputs):
        return adapter.step_key(parse(adapter, params(**inputs)))

    assert key() == key(true_cfg_scale=7.0)  # 4.0 (the default) vs 7.0, no negative prompt: no CFG either way
    assert key(negative_prompt="blurry", true_cfg_scale=1.0) == key()
    assert key(negative_prompt="", true_cfg_scale=4.0) != key()  # any negative prompt turns CFG on
    assert key(negative_prompt="x", true_cfg_scale=2.0) != key(negative_prompt="x", true_cfg_scale=4.0)
    assert key(negative_prompt="x", true_cfg_scale=2) == key(negative_prompt="y", true_cfg_scale=2.0)
    assert key(prompt="a much longer prompt than the others", max_sequence_length=64) == key()
    assert key(num_images=2) != key() and key(height=128) != key()


def test_adapter_limits_and_flags(adapter):
    assert adapter.size_multiple == adapter.pipe.vae_scale_factor * 2 == 8
    runs = QwenImageAdapter.capabilities.supports
    assert runs("request_batch") and runs("step_execution") and runs("previews")


def test_registry_resolves_names_devices_dtypes_and_paths(monkeypatch, tiny_qwen_dir):
    from engine_lib.pipelines import registry
    from engine_lib.config import ConfigError

    assert registry.get_adapter_class("qwen_image") is QwenImageAdapter
    assert registry.get_adapter_class(EngineConfig().model.pipeline) is QwenImageAdapter
    with pytest.raises(ConfigError, match="qwen_image"):
        registry.get_adapter_class("nope")
    assert registry.resolve_device("cpu") == torch.device("cpu")
    assert registry.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert registry.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert registry.resolve_dtype("float16", torch.device("cpu")) == torch.float16
    monkeypatch.delenv(registry.MODEL_PATH_ENV, raising=False)
    monkeypatch.delenv(f"{registry.MODEL_PATH_ENV}_QWEN_IMAGE", raising=False)
    assert registry.resolve_model_path(EngineConfig()) == str(tiny_qwen_dir)
    monkeypatch.setenv(registry.MODEL_PATH_ENV, "/elsewhere")
    assert registry.resolve_model_path(EngineConfig()) == "/elsewhere"
    monkeypatch.setenv(f"{registry.MODEL_PATH_ENV}_QWEN_IMAGE", "/its/own")
    assert registry.resolve_model_path(EngineConfig()) == "/its/own"  # the per-pipeline variable wins
    assert registry.resolve_model_path(EngineConfig.of(pipeline="flux")) == "/elsewhere"
    assert registry.resolve_model_path(EngineConfig.of(model_path="/given")) == "/given"


@pytest.mark.parametrize("backend", ["native", "flex"])
def test_packed_forward_gives_each_row_what_its_own_forward_gives(adapter, backend):
    """The packed forward over rows whose token counts repeat out of row order (several attention groups,
    a row with masked text) gives every row diffusers' forward of that row alone, and zeros on its padding.
    Compared on the transformer's output, the most direct check of the packing (the image-level parity suite
    also catches a row given another row's text, since the tiny model's weights make it see its prompt). With
    the flex backend the joint attention is one call a block (a block mask over every row's segment), else one
    call per group."""
    transformer = adapter.pipe.transformer
    shapes = [(1, 4, 4), (1, 2, 2), (1, 2, 4), (1, 4, 2), (1, 4, 4)]
    lengths = [f * h * w for f, h, w in shapes]
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(len(shapes), max(lengths), transformer.config.in_channels, generator=gen)
    timestep = torch.rand(len(shapes), generator=gen)
    text = torch.randn(len(shapes), 7, transformer.config.joint_attention_dim, generator=gen)
    mask = torch.ones(len(shapes), 7, dtype=torch.long)
    mask[1, 5:] = 0
    packing = QwenPacking(transformer.pos_embed, shapes, torch.device("cpu"))
    assert [group.rows for group in packing.groups] == [[0, 4], [1], [2, 3]]
    with packed_attention_on(transformer, backend) as calls:
        together = packed_forward(transformer, latents, timestep, None, text, mask, packing)
    blocks = len(taylorseer.attention_modules(transformer))
    assert calls == [backend] * blocks * (1 if backend == "flex" else len(packing.groups))  # flex: one call
    for row, (shape, n) in enumerate(zip(shapes, lengths)):
        with torch.inference_mode():
            alone = transformer(hidden_states=latents[row:row + 1, :n], timestep=timestep[row:row + 1],
                                encoder_hidden_states=text[row:row + 1], encoder_hidden_states_mask=mask[row:row + 1],
                                img_shapes=[[shape]], return_dict=False)[0]
        torch.testing.assert_close(together[row:row + 1, :n], alone, rtol=1e-4, atol=1e-5)
        assert not together[row, n:].any()
