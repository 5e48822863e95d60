"""The Flux adapter against `FluxPipeline.__call__`, on the tiny random-weight pipeline (CPU, float32).

Solo runs (request mode and step mode) must be bitwise what diffusers gives;
batched runs may differ only by batch-size dependent CPU kernels (FLOAT_BOUND).
The shared suite (parity_checks.FlowMatchParitySuite) runs here; this module
adds what is Flux's own: per-row embedded guidance and the text length in the keys.
"""

from __future__ import annotations

import pytest
import torch

from engine_lib.config import EngineConfig
from engine_lib.interface import to_uint8
from engine_lib.pipelines import taylorseer
from engine_lib.pipelines.flux.adapter import DEFAULT_GUIDANCE_SCALE, FluxAdapter
from engine_lib.pipelines.flux.mixed_sizes import FluxPacking, packed_forward
from engine_lib.pipelines.registry import get_adapter_class
from engine_lib.request import InvalidInputError
from tests.helpers.parity_checks import (PROMPTS, Arrival, FlowMatchParitySuite, assert_close_images, image_diff,
                                         load_tiny_adapter, packed_attention_on, parse, pipe_reference, run_steps,
                                         with_cfg_batching)

# Flux's default 512 T5 tokens dominate the tiny model's cost; most tests use 32
# (one test runs the default).
TEXT_LENGTH = 32


@pytest.fixture(scope="module")
def adapter() -> FluxAdapter:
    return load_tiny_adapter("flux", FluxAdapter)


@pytest.fixture(scope="module")
def bitwise_adapter(adapter) -> FluxAdapter:
    """cfg_batching off: FluxPipeline runs true CFG as two forwards of B rows."""
    return with_cfg_batching(adapter, False)


@pytest.fixture(scope="module")
def reference(adapter):
    return pipe_reference(adapter)


class TestFluxParity(FlowMatchParitySuite):
    BASE = dict(max_sequence_length=TEXT_LENGTH)
    NO_CFG = dict(guidance_scale=2.5)
    CFG = dict(guidance_scale=2.5, negative_prompt="bad quality, blurry", true_cfg_scale=4.0)


params = TestFluxParity.params


def without(inputs: dict, name: str) -> dict:
    return {k: v for k, v in inputs.items() if k != name}


def test_per_row_guidance_in_one_forward_matches_solo(adapter, reference):
    """Rows with different embedded guidance (and the default) share one forward and each matches its solo run."""
    scales = [None, 1.0, 3.5, 6.0]
    arrivals = [Arrival(i // 2, f"r{i}", params(PROMPTS[i], steps=3 + i % 2, seed=40 + i, guidance_scale=g))
                for i, g in enumerate(scales)]
    result = run_steps(adapter, arrivals, float_output=True)
    assert max(result.forward_sizes) == 4
    diffs = [assert_close_images(result.images[a.request_id], reference(a.params), to_uint8) for a in arrivals]
    print(f"flux per-row guidance: max abs diff per request {['%.2e' % d for d in diffs]}")
    # Unset is diffusers' default (3.5), and the guidance matters.
    default = {**arrivals[0].params, "guidance_scale": DEFAULT_GUIDANCE_SCALE}
    assert_close_images(result.images["r0"], reference(default), to_uint8)
    other_guidance = {**arrivals[1].params, "guidance_scale": 6.0}
    assert image_diff(result.images["r1"], reference(other_guidance)) > 1e-3
    # ... and the engine's keys let them share: guidance is a per-row input for Flux.
    keys = {adapter.step_key(parse(adapter, a.params)) for a in arrivals}
    assert len(keys) == 1


def test_text_length_is_part_of_the_keys(adapter):
    def key(inputs):
        return adapter.step_key(parse(adapter, inputs))

    short, default = params(), without(params(), "max_sequence_length")
    assert ("text_length", TEXT_LENGTH) in adapter.key_fields(parse(adapter, short))
    assert ("text_length", 512) in adapter.key_fields(parse(adapter, default))
    assert key(short) != key(default)
    assert key(default) == key({**default, "max_sequence_length": 512})  # the default, sent or left out
    # Seeds, prompts and step counts never split a step batch.
    assert key(short) == key(params(PROMPTS[2], steps=7, seed=9))


def test_max_sequence_length_option_sets_the_default(adapter):
    configured = FluxAdapter(adapter.pipe, adapter.device, adapter.dtype, EngineConfig.of(max_sequence_length=64))
    assert parse(configured, {"prompt": "x"}).max_sequence_length == 64
    assert configured.text_length(parse(configured, {"prompt": "x", "max_sequence_length": 16})) == 16
    with pytest.raises(ValueError, match="max_sequence_length"):
        FluxAdapter(adapter.pipe, adapter.device, adapter.dtype, EngineConfig.of(max_sequence_length=1024))


def test_guidance_is_rejected_by_checkpoints_without_guidance_embeddings(adapter, monkeypatch):
    parse(adapter, params(guidance_scale=0.0))
    from diffusers.configuration_utils import FrozenDict

    transformer = adapter.pipe.transformer
    monkeypatch.setattr(transformer, "_internal_dict", FrozenDict({**transformer.config, "guidance_embeds": False}))
    assert not transformer.config.guidance_embeds
    assert parse(adapter, without(params(), "guidance_scale")).guidance_scale is None  # no default forced on it
    with pytest.raises(InvalidInputError) as info:
        parse(adapter, params(guidance_scale=3.5))
    assert info.value.input_name == "guidance_scale" and "no guidance embeddings" in str(info.value)


def test_registry_and_flags():
    assert get_adapter_class("flux") is FluxAdapter
    runs = FluxAdapter.capabilities.supports
    assert runs("request_batch") and runs("step_execution") and runs("previews")
    assert FluxAdapter.cfg_kind == "true_cfg" and FluxAdapter.input_spec("guidance_scale").batch == "row"


@pytest.mark.parametrize("backend", ["native", "flex"])
def test_packed_forward_gives_each_row_what_its_own_forward_gives(adapter, backend):
    """The packed forward over rows whose token counts repeat out of row order (several attention groups;
    2x4 and 4x2 share a count but not their positions), each with its own timestep and guidance, gives every
    row diffusers' forward of that row alone, and zeros on its padding: through the double-stream block,
    where text and image have their own layers, and the single-stream one, where they share them. With the
    flex backend the joint attention is one call a block (a block mask over every row's segment)."""
    pipe = adapter.pipe
    transformer = pipe.transformer
    shapes = [(4, 4), (2, 2), (2, 4), (4, 2), (4, 4)]
    img_ids = [pipe._prepare_latent_image_ids(1, h, w, "cpu", torch.float32) for h, w in shapes]
    lengths = [ids.shape[0] for ids in img_ids]
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(len(shapes), max(lengths), transformer.config.in_channels, generator=gen)
    timestep, guidance = torch.rand(len(shapes), generator=gen), 1 + 4 * torch.rand(len(shapes), generator=gen)
    text = torch.randn(len(shapes), 7, transformer.config.joint_attention_dim, generator=gen)
    pooled = torch.randn(len(shapes), transformer.config.pooled_projection_dim, generator=gen)
    txt_ids = torch.zeros(7, 3)
    packing = FluxPacking(transformer.pos_embed, txt_ids, img_ids, torch.device("cpu"))
    assert [group.rows for group in packing.groups] == [[0, 4], [1], [2, 3]]
    with packed_attention_on(transformer, backend) as calls:
        together = packed_forward(transformer, latents, timestep, guidance, pooled, text, packing)
    blocks = len(taylorseer.attention_modules(transformer))
    assert calls == [backend] * blocks * (1 if backend == "flex" else len(packing.groups))  # flex: one call
    for row, n in enumerate(lengths):
        with torch.inference_mode():
            alone = transformer(hidden_states=latents[row:row + 1, :n], timestep=timestep[row:row + 1],
                                guidance=guidance[row:row + 1], pooled_projections=pooled[row:row + 1],
                                encoder_hidden_states=text[row:row + 1], txt_ids=txt_ids, img_ids=img_ids[row],
                                return_dict=False)[0]
        torch.testing.assert_close(together[row:row + 1, :n], alone, rtol=1e-4, atol=1e-5)
        assert not together[row, n:].any()
