"""SD3 inpainting (`image`, `mask_image`, `strength`) against `StableDiffusion3InpaintPipeline` on the tiny pipeline
(CPU, float32): solo runs bitwise (its latents, then decoded as every other SD3 pipeline decodes), a step batch
of text-to-image, image-to-image and inpainting requests with different masks each within a uint8 level of its
solo run, the mask in the request's own state (kept across a pause, freed on abort)."""

from __future__ import annotations

import gc
import io
import weakref

import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3InpaintPipeline
from diffusers.configuration_utils import FrozenDict
from PIL import Image

from engine_lib.pipelines.sd3.adapter import SD3Adapter
from engine_lib.request import DiffusionRequest, InvalidInputError
from engine_lib.runner import ModelRunner
from tests.helpers.parity_checks import (PROMPTS, Arrival, load_tiny_adapter, parse, run_arrivals, run_steps,
                                         solo_steps, step_engine)
from tests.helpers.sd3_img2img_inputs import params as img2img_params


def encoded(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def masks() -> list[bytes]:
    """A left half (L, another size than the request's), a centre square (RGBA: its gray, not its alpha,
    counts), and an RGB stripe of gray levels around the binarizing 0.5."""
    half = np.zeros((40, 48), np.uint8)
    half[:, :24] = 255
    square = np.zeros((64, 64, 4), np.uint8)
    square[16:48, 16:48, :3] = 255
    square[..., 3] = 255
    stripe = np.zeros((32, 32, 3), np.uint8)
    stripe[:, 8:24] = np.linspace(100, 160, 16, dtype=np.uint8)[None, :, None]
    return [encoded(Image.fromarray(half)), encoded(Image.fromarray(square, "RGBA")), encoded(Image.fromarray(stripe))]


MASKS = masks()


def params(image: int = 0, mask: int = 0, strength: float = 0.6, **kw) -> dict:
    return {**img2img_params(image, strength, **kw), "mask_image": MASKS[mask]}


@pytest.fixture(scope="module")
def adapter() -> SD3Adapter:
    return load_tiny_adapter("sd3", SD3Adapter)


@pytest.fixture(scope="module")
def inpaint(adapter):
    """diffusers' inpainting pipeline on the very same components: its latents, decoded as the adapter decodes
    (diffusers' inpainting decode leaves out the VAE's shift_factor; text-to-image and image-to-image add it).

    The pipeline blends only for a transformer of 16 input channels (SD3's) and refuses other counts than 16
    and 33; the tiny one has 4 latent channels, so its config says 16 while the reference runs (the pipeline
    reads in_channels for those checks alone)."""
    pipe = StableDiffusion3InpaintPipeline(**adapter.pipe.components)
    pipe.set_progress_bar_config(disable=True)
    transformer = adapter.pipe.transformer

    def run(inputs):
        config = transformer._internal_dict
        transformer._internal_dict = FrozenDict({**config, "in_channels": 16})
        try:
            latents = pipe(**adapter.pipe_kwargs(parse(adapter, inputs)), output_type="latent").images
        finally:
            transformer._internal_dict = config
        with torch.inference_mode():
            return adapter.pipe.image_processor.postprocess(adapter._vae_decode(latents), output_type="np")
    return run


def test_the_transformer_is_the_text_to_image_one(adapter):
    """No mask or masked-image channels (diffusers' 33-channel case): the mask only blends."""
    assert adapter.pipe.transformer.config.in_channels == adapter.latent_channels


@pytest.mark.parametrize("inputs", [
    params(),
    params(image=1, mask=1, strength=1.0, guidance_scale=5.0, negative_prompt="blurry", num_images=2, seed=4,
           steps=3),
    params(image=2, mask=2, strength=0.5, steps=4),
], ids=["half-0.6", "cfg-two-images-strength-1", "gray-stripe-0.5"])
def test_solo_matches_diffusers_inpaint_bitwise(adapter, inpaint, inputs):
    np.testing.assert_array_equal(solo_steps(adapter, inputs, float_output=True), inpaint(inputs))


@torch.inference_mode()
def test_outside_the_mask_the_latents_end_as_the_image_latents(adapter):
    state = adapter.new_state("r", parse(adapter, params(steps=3)))
    adapter.prepare_encode(state)
    assert state.mask.shape == (1, state.latents.shape[1], 1) and set(state.mask.unique().tolist()) == {0.0, 1.0}
    while state.step_index < state.num_steps:
        adapter.step_scheduler(state, torch.randn(state.latents.shape, generator=torch.Generator().manual_seed(0)))
    kept = state.mask[..., 0] == 0
    assert torch.equal(state.latents[kept], state.image_latents[kept])
    assert not torch.equal(state.latents[~kept], state.image_latents[~kept])


def test_validation(adapter):
    without_image = {k: v for k, v in params(strength=1.0).items() if k not in ("image", "strength")}
    with pytest.raises(InvalidInputError, match="input 'mask_image': needs an image"):
        parse(adapter, without_image)
    with pytest.raises(InvalidInputError, match="input 'mask_image': is not a PNG"):
        parse(adapter, params() | {"mask_image": b"not an image"})
    assert adapter.step_key(parse(adapter, params())) == adapter.step_key(parse(adapter, img2img_params()))


def test_step_batch_of_text_image_and_masks_matches_solo(adapter):
    """Text-to-image, image-to-image and two inpainting requests (other masks, images, strengths and prompts)
    join at different ticks, each row blended with its own mask and image: each within a uint8 level of its
    solo run."""
    text = {k: v for k, v in img2img_params(prompt=PROMPTS[0], seed=1).items() if k not in ("image", "strength")}
    arrivals = [Arrival(0, "text", text),
                Arrival(0, "img2img", img2img_params(0, 0.8, PROMPTS[1], seed=2)),
                Arrival(1, "half", params(0, 0, 0.8, prompt=PROMPTS[2], seed=2)),
                Arrival(2, "square", params(1, 1, 1.0, prompt=PROMPTS[3], seed=3))]
    result = run_steps(adapter, arrivals, capacity=4)
    assert max(result.forward_sizes) == 4, result.forward_sizes
    for a in arrivals:
        levels = np.abs(result.images[a.request_id].astype(np.int16) - solo_steps(adapter, a.params).astype(np.int16))
        assert levels.max() <= 1, (a.request_id, levels.max())


def test_the_mask_lives_in_the_state_and_is_freed_on_abort(adapter):
    runner = ModelRunner(adapter)
    runner.execute_step([DiffusionRequest("r", parse(adapter, params()), num_steps=3)], [])
    state = runner.states["r"]
    assert state.mask.shape[:2] == state.noise.shape[:2] == state.latents.shape[:2]
    gone = [weakref.ref(state.mask), weakref.ref(state.noise)]
    del state
    runner.free(["r"])  # an abort
    gc.collect()
    assert all(ref() is None for ref in gone) and not runner.states


def test_pause_and_resume_equal_the_uninterrupted_run(adapter):
    """A running inpainting request paused for a more urgent one (one seat) ends as it does alone."""
    slow = Arrival(0, "slow", parse(adapter, params(strength=0.8)), priority=2)
    urgent = Arrival(2, "urgent", parse(adapter, params(image=1, mask=1, seed=5, steps=2, strength=1.0)), priority=1)
    result = run_arrivals(step_engine(adapter, capacity=1, max_preemptions=1), [slow, urgent])
    assert result.paused == ["slow"]
    np.testing.assert_array_equal(result.images["slow"], solo_steps(adapter, slow.params))
    np.testing.assert_array_equal(result.images["urgent"], solo_steps(adapter, urgent.params))
