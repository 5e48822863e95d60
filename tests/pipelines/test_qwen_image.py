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
from engine_lib.pipelines.qwen_image import QwenImageAdapter
from engine_lib.request import InvalidInputError, SamplingParams
from parity_checks import FlowMatchParitySuite, load_tiny_adapter, make_reference, with_cfg_batching


@pytest.fixture(scope="module")
def adapter() -> QwenImageAdapter:
    return load_tiny_adapter("qwen_image", QwenImageAdapter)


@pytest.fixture(scope="module")
def bitwise_adapter(adapter) -> QwenImageAdapter:
    """cfg_batching off: QwenImagePipeline runs true CFG as two forwards of B rows."""
    return with_cfg_batching(adapter, False)


@pytest.fixture(scope="module")
def reference(adapter):
    return make_reference(adapter, ("negative_prompt", "true_cfg_scale"))


class TestQwenImageParity(FlowMatchParitySuite):
    CFG = dict(negative_prompt="bad quality, blurry", true_cfg_scale=4.0)
    STEPS = (4, 7)
    PADS_TEXT = True  # prompts keep their own token count; a batch pads to the longest
    CHECKPOINT_REJECTS = frozenset({"guidance_scale"})  # the tiny checkpoint is not guidance-distilled


params = TestQwenImageParity.params


def test_a_single_step_is_rejected_for_its_nan_schedule(adapter):
    """The shared suite rejects 0 steps; Qwen-Image's shift_terminal schedule also needs 2."""
    adapter.validate(params(steps=2))
    with pytest.raises(InvalidInputError) as info:
        adapter.validate(SamplingParams(prompt="x", num_inference_steps=1))
    assert info.value.input_name == "num_inference_steps" and "NaN" in str(info.value)


def test_adapter_limits_and_flags(adapter):
    assert adapter.size_multiple == adapter.pipe.vae_scale_factor * 2 == 8
    assert QwenImageAdapter.supports_request_batch and QwenImageAdapter.supports_step_execution
    assert QwenImageAdapter.supports_previews


def test_registry_resolves_names_devices_dtypes_and_paths(monkeypatch, tiny_qwen_dir):
    from engine_lib.pipelines import registry
    from engine_lib.request import ConfigError

    assert registry.get_adapter_class("qwen_image") is QwenImageAdapter
    assert registry.get_adapter_class(EngineConfig().pipeline) is QwenImageAdapter
    with pytest.raises(ConfigError, match="qwen_image"):
        registry.get_adapter_class("nope")
    assert registry.resolve_device("cpu") == torch.device("cpu")
    assert registry.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert registry.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert registry.resolve_dtype("float16", torch.device("cpu")) == torch.float16
    monkeypatch.delenv(registry.MODEL_PATH_ENV, raising=False)
    assert registry.resolve_model_path(EngineConfig()) == str(tiny_qwen_dir)
    monkeypatch.setenv(registry.MODEL_PATH_ENV, "/elsewhere")
    assert registry.resolve_model_path(EngineConfig()) == "/elsewhere"
    assert registry.resolve_model_path(EngineConfig(model_path="/given")) == "/given"
