"""Qwen-Image-Edit (`image`) against `QwenImageEditPipeline` on the tiny pipeline (CPU, float32): solo runs
bitwise, requests with different images and prompts in one step batch each within a uint8 level of its solo
run, the condition latents in the request's own state (freed on abort, kept across a pause), the prompt
embeddings cached per image; Qwen-Image-Edit-Plus (`image` [n]) against `QwenImageEditPlusPipeline` with two
images, and its bound on them.

The pipeline encodes every image at about 1024x1024 (a few seconds on the tiny VAE), so each test runs as few
requests as it can, and solo runs are memoised."""

from __future__ import annotations

import functools
import gc
import io
import weakref

import numpy as np
import pytest
import torch
from PIL import Image

from engine_lib.pipelines.qwen_image_edit.adapter import MAX_IMAGES, QwenImageEditAdapter, QwenImageEditPlusAdapter
from engine_lib.request import DiffusionRequest, InvalidInputError
from engine_lib.runner import ModelRunner
from tests.helpers.parity_checks import (PROMPTS, Arrival, load_tiny_adapter, parse, pipe_reference, run_arrivals,
                                         run_steps, solo_steps, step_engine)


def png(width: int, height: int, color: tuple) -> bytes:
    """One colour: what the tiny VAE, at 16x down, tells apart (random pixels all average to one grey)."""
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


# 3:2 (one condition shape; each moves the image by more than 200 levels from the others), then 2:3
IMAGES = [png(48, 32, (0, 0, 0)), png(96, 64, (255, 255, 255)), png(24, 16, (255, 0, 0)), png(32, 48, (0, 0, 255))]


def params(image: int = 0, prompt: str = PROMPTS[0], seed: int = 3, steps: int = 3, **kw) -> dict:
    return {"prompt": prompt, "num_inference_steps": steps, "seed": seed, "image": IMAGES[image], **kw}


@pytest.fixture(scope="module")
def adapter() -> QwenImageEditAdapter:
    return load_tiny_adapter("qwen_image_edit", QwenImageEditAdapter)


@pytest.fixture(scope="module")
def solo(adapter):
    """A request's image run alone through the engine's runner (memoised)."""
    return functools.lru_cache(maxsize=None)(lambda p: solo_steps(adapter, p))


def test_solo_with_true_cfg_matches_diffusers_bitwise(adapter):
    """A 3:2 image (encoded at 1248x832), true CFG on a negative prompt, two images per prompt."""
    inputs = params(negative_prompt="blurry", true_cfg_scale=4.0, num_images=2, steps=2)
    expected = pipe_reference(adapter)(inputs)
    np.testing.assert_array_equal(solo_steps(adapter, parse(adapter, inputs), float_output=True), expected)


def test_images_and_prompts_share_a_step_batch_only_within_one_condition_shape(adapter):
    keys = {i: adapter.step_key(parse(adapter, params(i, PROMPTS[i], seed=i))) for i in range(4)}
    assert keys[0] == keys[1] == keys[2] != keys[3]  # 3:2 images (any size) share; a 2:3 one does not
    assert adapter.condition_shapes(parse(adapter, params(0))) == ((1, 26, 39),)  # 832x1248 / 32
    assert adapter.condition_shapes(parse(adapter, params(3))) == ((1, 39, 26),)


def test_the_prompt_cache_keys_on_the_image(adapter):
    """A cached embedding of a prompt with one image never serves the same prompt with another: the vision
    tokens are part of the embedding."""
    one, other = parse(adapter, params(0)), parse(adapter, params(1))
    assert adapter._text_key(one) != adapter._text_key(other)
    assert adapter._text_key(one) == adapter._text_key(parse(adapter, params(0, seed=9)))
    embeds = [adapter._encode(adapter.new_state(str(i), p))["cond"]["embeds"] for i, p in enumerate((one, other))]
    assert embeds[0].shape == embeds[1].shape and not torch.equal(*embeds)


def test_validation(adapter):
    with pytest.raises(InvalidInputError, match="input 'image': is required"):
        parse(adapter, {k: v for k, v in params().items() if k != "image"})
    with pytest.raises(InvalidInputError, match="input 'image': is not a PNG"):
        parse(adapter, params() | {"image": b"not an image"})
    # Edit gives its vision encoder the VAE's image: 1x4096 is resized to 0x65536, 3x512 to 64x13376 (209:1)
    for width, height, says in ((1, 4096, "0x65536"), (3, 512, "64x13376"), (1, 200, "64x14496")):
        with pytest.raises(InvalidInputError, match=f"input 'image': {width}x{height} is too far from square: "
                                                    f"the pipeline resizes it to {says}"):
            parse(adapter, params() | {"image": png(width, height, (0, 0, 0))})
    assert adapter.vae_sizes(parse(adapter, params() | {"image": png(1, 150, (0, 0, 0))})) == [(96, 12544)]  # 131:1


def test_step_batch_of_different_images_and_prompts_matches_solo(adapter, solo):
    """Three requests (three images of one aspect ratio; a and b one prompt and seed, c another) join at ticks 0,
    1 and 1: each within a uint8 level of its solo run, and a and b far apart (each row its own condition)."""
    arrivals = [Arrival(0, "a", parse(adapter, params(0, PROMPTS[0], seed=1))),
                Arrival(1, "b", parse(adapter, params(1, PROMPTS[0], seed=1))),
                Arrival(1, "c", parse(adapter, params(2, PROMPTS[2], seed=3, steps=2)))]
    result = run_steps(adapter, arrivals, capacity=3)
    assert max(result.forward_sizes) == 3, result.forward_sizes
    for a in arrivals:
        levels = np.abs(result.images[a.request_id].astype(np.int16) - solo(a.params).astype(np.int16))
        assert levels.max() <= 1, (a.request_id, levels.max())
    assert np.abs(result.images["a"].astype(int) - result.images["b"].astype(int)).max() > 100


def test_with_mixed_size_batching_two_output_sizes_and_two_condition_shapes_share_every_forward(adapter, solo):
    """mixed_size_batching: a 3:2 and a 2:3 image, outputs of 64x64 and 32x96, join at ticks 0, 1 and 1 and share
    every forward (each row's output tokens, then its own condition's, packed with its own RoPE): each within a
    uint8 level of its solo run."""
    mixed = type(adapter)(adapter.pipe, adapter.device, adapter.dtype, adapter.config.replace(mixed_size_batching=True))
    mixed.loras = adapter.loras
    arrivals = [Arrival(0, "a", parse(adapter, params(0, PROMPTS[0], seed=1))),
                Arrival(1, "b", parse(adapter, params(3, PROMPTS[1], seed=2, height=32, width=96))),
                Arrival(1, "c", parse(adapter, params(2, PROMPTS[2], seed=3, steps=2)))]
    assert len({mixed.step_key(a.params) for a in arrivals}) == 1
    result = run_steps(mixed, arrivals, capacity=3)
    assert result.forward_sizes == [1, 3, 3, 1], result.forward_sizes
    for a in arrivals:
        levels = np.abs(result.images[a.request_id].astype(np.int16) - solo(a.params).astype(np.int16))
        assert levels.max() <= 1, (a.request_id, levels.max())


def test_the_condition_lives_in_the_state_is_kept_across_a_pause_and_freed_on_abort(adapter, solo):
    """A running request paused for a more urgent one (one seat) ends as it does alone; an abort frees its
    condition latents."""
    slow = Arrival(0, "slow", parse(adapter, params(0, PROMPTS[0], seed=1)), priority=2)
    urgent = Arrival(1, "urgent", parse(adapter, params(1, PROMPTS[0], seed=1)), priority=1)
    result = run_arrivals(step_engine(adapter, capacity=1, max_preemptions=1), [slow, urgent])
    assert result.paused == ["slow"]
    np.testing.assert_array_equal(result.images["slow"], solo(slow.params))
    np.testing.assert_array_equal(result.images["urgent"], solo(urgent.params))

    runner = ModelRunner(adapter)
    runner.execute_step([DiffusionRequest("r", slow.params, num_steps=3)], [])
    state = runner.states["r"]
    assert state.image_latents.shape == (1, 26 * 39, state.latents.shape[2])
    assert not any(v is state.image_latents for v in vars(adapter).values())  # nothing on the adapter
    gone = weakref.ref(state.image_latents)
    del state
    runner.free(["r"])  # an abort
    gc.collect()
    assert gone() is None and not runner.states


def test_edit_plus_with_two_images_matches_diffusers_bitwise():
    """Two images of different aspect ratios: each its own condition tokens and shape, its own vision tokens."""
    plus = load_tiny_adapter("qwen_image_edit_plus", QwenImageEditPlusAdapter)
    inputs = params(steps=2) | {"image": [IMAGES[0], IMAGES[3]]}
    assert plus.condition_shapes(parse(plus, inputs)) == ((1, 26, 39), (1, 39, 26))
    expected = pipe_reference(plus)(inputs)
    np.testing.assert_array_equal(solo_steps(plus, parse(plus, inputs), float_output=True), expected)
    # one image alone is a request of its own (the bytes of one file stand for a list of one)
    assert parse(plus, params()).image == parse(plus, params() | {"image": [IMAGES[0]]}).image
    with pytest.raises(InvalidInputError, match=f"input 'image': {MAX_IMAGES + 1} values; 1 to {MAX_IMAGES} allowed"):
        parse(plus, params() | {"image": [IMAGES[0]] * (MAX_IMAGES + 1)})
    with pytest.raises(InvalidInputError, match="input 'image': is not a PNG"):
        parse(plus, params() | {"image": [IMAGES[0], b"not an image"]})
    with pytest.raises(InvalidInputError, match="input 'image': 4096x1 is too far from square"):
        parse(plus, params() | {"image": [IMAGES[0], png(4096, 1, (0, 0, 0))]})
    # Edit-Plus's vision encoder sees 3x512 at 32x5024 (157:1): taken
    assert plus.vision_sizes(parse(plus, params() | {"image": [png(3, 512, (0, 0, 0))]})) == [(32, 5024)]


def test_edit_plus_with_mixed_size_batching_one_and_two_images_share_every_forward():
    """mixed_size_batching: a request of one image and one of two (three condition shapes in all, each its own
    frame index in the row's RoPE) share every forward, each within a uint8 level of its solo run."""
    plus = load_tiny_adapter("qwen_image_edit_plus", QwenImageEditPlusAdapter)
    mixed = type(plus)(plus.pipe, plus.device, plus.dtype, plus.config.replace(mixed_size_batching=True))
    mixed.loras = plus.loras
    arrivals = [Arrival(0, "one", parse(plus, params(3, PROMPTS[0], seed=1, steps=2))),
                Arrival(0, "two", parse(plus, params(steps=2, seed=2) | {"image": [IMAGES[0], IMAGES[3]]}))]
    result = run_steps(mixed, arrivals, capacity=2)
    assert result.forward_sizes == [2, 2], result.forward_sizes
    for a in arrivals:
        levels = np.abs(result.images[a.request_id].astype(np.int16) - solo_steps(plus, a.params).astype(np.int16))
        assert levels.max() <= 1, (a.request_id, levels.max())
