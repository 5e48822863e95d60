"""The FLUX.2 [klein] adapter against `Flux2KleinPipeline.__call__`, on the tiny random-weight pipeline (CPU, float32).

Solo runs must be bitwise what diffusers gives; batched runs may differ only by batch-size dependent
CPU kernels (FLOAT_BOUND). The shared suite runs here; this module adds what is FLUX.2's own: CFG on
the empty prompt only, none on step-distilled checkpoints, and the VAE's batch-norm statistics.
"""

from __future__ import annotations

import pytest
import torch

from engine_lib.interface import to_uint8
from engine_lib.pipelines.flux2.adapter import Flux2Adapter
from engine_lib.request import InvalidInputError
from tests.helpers.parity_checks import (PROMPTS, Arrival, FlowMatchParitySuite, assert_close_images, image_diff,
                                         load_tiny_adapter, parse, pipe_reference, run_steps, solo_steps,
                                         with_cfg_batching)

TEXT_LENGTH = 32  # Qwen3 tokens per prompt (diffusers' default, 512, runs in one test)


@pytest.fixture(scope="module")
def adapter() -> Flux2Adapter:
    return load_tiny_adapter("flux2", Flux2Adapter)


@pytest.fixture(scope="module")
def bitwise_adapter(adapter) -> Flux2Adapter:
    """cfg_batching off: Flux2KleinPipeline runs CFG as two forwards of B rows."""
    return with_cfg_batching(adapter, False)


@pytest.fixture(scope="module")
def reference(adapter):
    return pipe_reference(adapter)


class TestFlux2Parity(FlowMatchParitySuite):
    BASE = dict(max_sequence_length=TEXT_LENGTH)
    SEEDS = (0, 1)  # two seeds x two step counts x CFG on and off are bitwise; a third seed adds time, not cases
    NO_CFG = dict(guidance_scale=1.0)
    CFG = dict(guidance_scale=2.7)


params = TestFlux2Parity.params


def test_cfg_runs_the_empty_prompt_and_a_negative_prompt_is_refused(adapter):
    assert adapter.do_cfg(parse(adapter, params(guidance_scale=1.3)))
    assert not adapter.do_cfg(parse(adapter, params(guidance_scale=1.0)))
    with pytest.raises(InvalidInputError) as info:
        parse(adapter, params(guidance_scale=4.0, negative_prompt="blurry"))
    assert info.value.input_name == "negative_prompt" and "does not use" in str(info.value)


def test_the_step_cache_and_an_image_are_refused_by_name(adapter):
    """diffusers' first-block cache fails on this transformer and image conditioning is not built
    (docs/pipelines.md): neither is an input."""
    for name, value in (("cache", "first_block"), ("image", b"x")):
        with pytest.raises(InvalidInputError) as info:
            parse(adapter, params(**{name: value}))
        assert info.value.input_name == name and "does not use" in str(info.value)


def test_a_step_distilled_checkpoint_runs_without_cfg_and_refuses_guidance(adapter, monkeypatch):
    from diffusers.configuration_utils import FrozenDict

    # what FLUX.2 [klein] 4B's model_index.json says (the pipeline reads it too)
    monkeypatch.setattr(adapter.pipe, "_internal_dict", FrozenDict({**adapter.pipe.config, "is_distilled": True}))
    p = {k: v for k, v in params(steps=3, seed=2).items() if k != "guidance_scale"}
    assert not adapter.do_cfg(parse(adapter, p))  # the declared default 4.0 would run CFG on the base model
    with pytest.raises(InvalidInputError) as info:
        parse(adapter, params(guidance_scale=4.0))
    assert info.value.input_name == "guidance_scale" and "step-distilled" in str(info.value)
    distilled = adapter.pipe(**adapter.pipe_kwargs(parse(adapter, p)), output_type="np").images
    assert_close_images(solo_steps(adapter, p, float_output=True), distilled, to_uint8)


def test_three_requests_joining_at_different_ticks_with_cfg_and_two_images(adapter, reference):
    """Three CFG requests join at ticks 0, 1 and 3 (one with two images): each within 1 uint8 level of diffusers."""
    arrivals = [Arrival(0, "a", params(PROMPTS[0], cfg=True, steps=5, seed=1, num_images=2)),
                Arrival(1, "b", params(PROMPTS[2], cfg=True, steps=4, seed=2)),
                Arrival(3, "c", params(PROMPTS[3], cfg=True, steps=3, seed=3))]
    result = run_steps(adapter, arrivals, capacity=3, float_output=True)
    assert max(result.forward_sizes) == 3
    for a in arrivals:
        assert_close_images(result.images[a.request_id], reference(a.params), to_uint8)


def test_the_vae_statistics_shape_the_image(adapter, reference):
    """The tiny VAE's batch-norm statistics are not the identity, so decoding without them would show."""
    bn = adapter.pipe.vae.bn
    assert float(bn.running_mean.abs().max()) > 0.01 and float((bn.running_var - 1).abs().max()) > 0.05
    p = params(steps=2, seed=4)
    state = adapter.new_state("r", parse(adapter, p))
    adapter.prepare_encode(state)
    with torch.inference_mode():
        latents = adapter._unpack(state.latents, 64, 64)
        plain = adapter.pipe.vae.decode(adapter.pipe._unpatchify_latents(latents), return_dict=False)[0]
        assert image_diff(plain.numpy(), adapter._vae_decode(latents).numpy()) > 1e-2


@pytest.mark.parametrize("pipeline", ["flux2", "z_image"])
@pytest.mark.parametrize("parameter, value", [("sequence_parallel_size", 2), ("cfg_parallel", True)])
def test_ranks_are_refused_at_load_naming_the_parameter(pipeline, parameter, value):
    """Neither runs on ranks yet (docs/deployment.md): the load fails before the weights, naming the parameter."""
    from engine_lib.config import EngineConfig
    from engine_lib.pipelines.registry import load_adapter
    from engine_lib.config import ConfigError

    with pytest.raises(ConfigError, match=f"parameter '{parameter}'"):
        load_adapter(EngineConfig.of(pipeline=pipeline, device="cpu", dtype="float32", devices="cpu,cpu",
                                     **{parameter: value}))
