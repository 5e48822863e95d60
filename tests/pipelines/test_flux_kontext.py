"""FLUX.1 Kontext (`image` + prompt) against `FluxKontextPipeline` on the tiny pipeline (CPU, float32): solo runs
bitwise, requests with different images and prompts in one step batch each within a uint8 level of its solo run,
the condition in the request's own state (kept across a pause, freed on abort), and the keys that let them share.

Images are kept at their size (`auto_resize=0`): resized to Kontext's megapixel resolutions a tiny request
takes a minute and a half (its parity with diffusers was measured so, not rerun here)."""

from __future__ import annotations

import gc
from functools import partial
import weakref

import numpy as np
import pytest
import torch
from PIL import Image

from engine_lib.interface import to_uint8
from engine_lib.pipelines.flux_kontext.adapter import FluxKontextAdapter
from engine_lib.request import DiffusionRequest, InvalidInputError
from engine_lib.runner import ModelRunner
from tests.helpers.hostile_images import encode, random_png
from tests.helpers.parity_checks import (FLOAT_BOUND, PROMPTS, Arrival, assert_close_images, image_diff,
                                         load_tiny_adapter, parse, pipe_reference, run_arrivals, run_steps, solo_steps,
                                         step_engine, with_cfg_batching)

RNG = np.random.default_rng(11)
png = partial(random_png, RNG)  # random images of other sizes than the requests'


IMAGES = [png(48, 40), png(44, 42), png(40, 47), png(64, 32)]  # the first three encode at 40x40 (multiples of 8)


def params(image: int = 0, prompt: str = PROMPTS[0], seed: int = 3, steps: int = 3, **kw) -> dict:
    return {"prompt": prompt, "num_inference_steps": steps, "seed": seed, "height": 32, "width": 48,
            "max_sequence_length": 32, "image": IMAGES[image], "auto_resize": 0, **kw}


@pytest.fixture(scope="module")
def adapter() -> FluxKontextAdapter:
    return load_tiny_adapter("flux_kontext", FluxKontextAdapter)


@pytest.mark.parametrize("inputs, cfg_batching", [
    (params(), True),
    (params(image=3, negative_prompt="blurry", true_cfg_scale=2.0, num_images=2, seed=4, guidance_scale=5.0), False),
], ids=["one-image", "true-cfg-two-images"])
def test_solo_matches_diffusers_bitwise(adapter, inputs, cfg_batching):
    """`FluxKontextPipeline(...)(image=..., prompt=..., generator=...)`, float and uint8 (true CFG as diffusers
    runs it: two forwards)."""
    runner = with_cfg_batching(adapter, cfg_batching)
    expected = pipe_reference(adapter)(inputs)
    assert expected.shape == (inputs["num_images"] if "num_images" in inputs else 1, 32, 48, 3)
    np.testing.assert_array_equal(solo_steps(runner, inputs, float_output=True), expected)
    np.testing.assert_array_equal(solo_steps(runner, inputs), to_uint8(expected))


def test_the_image_is_encoded_at_the_size_diffusers_resizes_it_to(adapter):
    sizes = [adapter.condition_size(parse(adapter, params(i))) for i in range(4)]
    assert sizes == [(40, 48), (40, 40), (40, 40), (32, 64)]
    # auto_resize: the preferred resolution nearest the aspect ratio (48/40 = 1.2: 1104x944)
    assert adapter.condition_size(parse(adapter, params(0, auto_resize=1))) == (944, 1104)


def test_requests_share_a_forward_only_with_the_same_output_and_condition_sizes(adapter):
    one, other = parse(adapter, params(1)), parse(adapter, params(2, PROMPTS[1], seed=9))
    assert adapter.step_key(one) == adapter.step_key(other)  # other image and prompt, one condition size
    assert adapter.step_key(one) != adapter.step_key(parse(adapter, params(0)))  # a 40x48 condition
    assert adapter.step_key(one) != adapter.step_key(parse(adapter, params(1, height=48)))
    assert adapter.request_cost(one) == 4 * 6 + 5 * 5  # output and condition tokens (8x8 pixels each)


def solid(width: int, height: int) -> bytes:
    return encode(Image.new("RGB", (width, height), (90, 160, 20)))


def test_validation_names_the_image(adapter):
    without = {k: v for k, v in params().items() if k != "image"}
    for inputs, says in ((without, "input 'image': is required"),
                         (params() | {"image": b"not an image"}, "input 'image': is not a PNG"),
                         (params() | {"image": png(6, 30)}, "input 'image': 6x30 is too small"),
                         # auto_resize reads the aspect ratio of 64x0 (the VAE's multiple): diffusers divides by 0
                         (params(auto_resize=1) | {"image": solid(64, 7)}, "input 'image': 64x7 is too small")):
        with pytest.raises(InvalidInputError, match=says):
            parse(adapter, inputs)
    assert parse(adapter, params(auto_resize=1) | {"image": solid(8, 4096)}).image.size == (8, 4096)


def test_a_step_batch_of_different_images_and_prompts_matches_solo(adapter):
    """Three requests with different images (one condition size) and prompts join at ticks 0, 1 and 1: they
    share forwards, each within the batched bound of its solo run (a uint8 level at most). The tiny model sees
    its image only a little (another image moves it about a level), so the check is on float images; the same
    prompt and seed on another image gives another image, by far more than the bound."""
    arrivals = [Arrival(0, "a", params(1, PROMPTS[0], seed=1, steps=4)),
                Arrival(1, "b", params(2, PROMPTS[1], seed=2, steps=3)),
                Arrival(1, "c", params(1, PROMPTS[1], seed=2, steps=3))]
    result = run_steps(adapter, arrivals, capacity=4, float_output=True)
    assert max(result.forward_sizes) == 3, result.forward_sizes
    for a in arrivals:
        assert_close_images(result.images[a.request_id], solo_steps(adapter, a.params, float_output=True), to_uint8)
    assert image_diff(result.images["b"], result.images["c"]) > 10 * FLOAT_BOUND  # each row its own image


@pytest.mark.parametrize("cfg", [{}, dict(negative_prompt="blurry", true_cfg_scale=2.7)], ids=["plain", "true-cfg"])
def test_with_mixed_size_batching_two_output_and_three_condition_sizes_share_every_forward(adapter, cfg):
    """mixed_size_batching: requests of two output sizes (32x48, 48x32) and three condition sizes join at
    ticks 0, 1 and 1 and share every forward (4 forwards, not the 10 of one size per forward): each row's latent
    tokens, then its own condition's, packed with its own ids; each within the batched bound of its solo run."""
    mixed = type(adapter)(adapter.pipe, adapter.device, adapter.dtype, adapter.config.replace(mixed_size_batching=True))
    arrivals = [Arrival(0, "a", params(0, PROMPTS[0], seed=1, steps=4, **cfg)),
                Arrival(1, "b", params(3, PROMPTS[1], seed=2, steps=3, height=48, width=32, **cfg)),
                Arrival(1, "c", params(1, PROMPTS[1], seed=2, steps=3, **cfg))]
    assert len({mixed.step_key(parse(mixed, a.params)) for a in arrivals}) == 1
    result = run_steps(mixed, arrivals, capacity=4, float_output=True)
    assert result.forward_sizes == [1, 3, 3, 3], result.forward_sizes
    for a in arrivals:
        assert_close_images(result.images[a.request_id], solo_steps(adapter, a.params, float_output=True), to_uint8)


def test_the_condition_lives_in_the_state_and_is_freed_on_abort(adapter):
    runner = ModelRunner(adapter)
    runner.execute_step([DiffusionRequest("r", parse(adapter, params(num_images=2)), num_steps=3)], [])
    state = runner.states["r"]
    assert state.image_latents.shape == (2, 5 * 6, state.latents.shape[2])  # 40x48 pixels: 5x6 packed tokens
    assert torch.equal(state.img_ids[state.latents.shape[1]:, 0], torch.ones(30))  # the condition's ids: index 1
    assert not any(isinstance(v, torch.Tensor) for v in vars(adapter).values())  # nothing on the adapter
    gone = weakref.ref(state.image_latents)
    del state
    runner.free(["r"])  # an abort
    gc.collect()
    assert gone() is None and not runner.states


def test_pause_and_resume_equal_the_uninterrupted_run(adapter):
    """A running request paused for a more urgent one (one seat) ends as it does alone."""
    slow = Arrival(0, "slow", parse(adapter, params(0, steps=4)), priority=2)
    urgent = Arrival(2, "urgent", parse(adapter, params(3, seed=5, steps=2)), priority=1)
    result = run_arrivals(step_engine(adapter, capacity=1, max_preemptions=1), [slow, urgent])
    assert result.paused == ["slow"]
    np.testing.assert_array_equal(result.images["slow"], solo_steps(adapter, slow.params))
    np.testing.assert_array_equal(result.images["urgent"], solo_steps(adapter, urgent.params))
