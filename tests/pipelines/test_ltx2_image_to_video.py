"""LTX-2 image to video (`image`) against `LTX2ImageToVideoPipeline` on the tiny pipeline (CPU, float32): solo
runs bitwise (video and audio), requests with different images and prompts and a text-to-video one sharing a
step batch each close to its solo run, the condition (first-frame latents and mask) in the request's own state,
kept across a pause and freed on abort."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from diffusers import LTX2ImageToVideoPipeline
from PIL import Image

from engine_lib.interface import to_uint8
from engine_lib.pipelines.base import move_tensors
from engine_lib.pipelines.ltx2.adapter import LTX2Adapter
from engine_lib.request import DiffusionRequest, InvalidInputError
from engine_lib.runner import ModelRunner
from tests.helpers.hostile_images import encode
from tests.helpers.parity_checks import (FLOAT_BOUND, PROMPTS, Arrival, assert_close_images, load_tiny_adapter, parse,
                                         run_arrivals, step_engine)
from tests.helpers.ltx2_runs import NO_GUIDANCE, params, run, text_only

@pytest.fixture(scope="module")
def adapter() -> LTX2Adapter:
    return load_tiny_adapter("ltx2", LTX2Adapter)


@pytest.fixture(scope="module")
def reference(adapter):
    """(video, audio) of diffusers' own call: `LTX2ImageToVideoPipeline` on the very same components for a
    request with an image, `LTX2Pipeline` without."""
    image_to_video = LTX2ImageToVideoPipeline(**adapter.pipe.components)
    image_to_video.set_progress_bar_config(disable=True)

    def call(inputs: dict):
        p = parse(adapter, inputs)
        pipe = adapter.pipe if p.image is None else image_to_video
        out = pipe(**adapter.pipe_kwargs(p), output_type="np")
        return out.frames, out.audio.numpy()
    return call


@pytest.mark.parametrize("inputs", [
    params(),
    params(image=1, prompt=PROMPTS[1], seed=4, num_frames=17, width=64, frame_rate=12.0, **NO_GUIDANCE),
], ids=["every-pass", "unguided-17-frames"])
def test_solo_is_the_image_to_video_pipelines_own(adapter, reference, inputs):
    frames, audio = reference(inputs)
    out = run(adapter, {"solo": (0, inputs)})["solo"]
    np.testing.assert_array_equal(out["video"], frames)
    np.testing.assert_array_equal(out["audio"], audio)


def test_validation_and_keys(adapter):
    with pytest.raises(InvalidInputError, match="input 'image': is not a PNG"):
        parse(adapter, params() | {"image": b"not an image"})
    for width, height in ((1, 64), (64, 1)):  # the pipeline's H.264 re-compression would crop it to no rows
        with pytest.raises(InvalidInputError, match=f"input 'image': {width}x{height} is too small: at least 2 pixels"):
            parse(adapter, params() | {"image": encode(Image.new("RGB", (width, height)))})
    assert parse(adapter, params() | {"image": encode(Image.new("RGB", (2, 64)))}).image.size == (2, 64)
    # the transformer takes a timestep per token: requests with and without an image share every forward
    assert adapter.step_key(parse(adapter, params())) == adapter.step_key(parse(adapter, text_only(params())))


def test_step_batch_of_different_images_prompts_and_a_text_request_matches_solo(adapter, reference):
    """Three image requests (all guidance passes, none, STG only) and a text-to-video one join at different
    ticks and share every forward, which then takes per-token timesteps: each within the batched tolerance of
    its solo run."""
    forwards = []  # (rows, timestep dims) of each transformer call
    handle = adapter.pipe.transformer.register_forward_pre_hook(
        lambda module, args, kw: forwards.append((kw["hidden_states"].shape[0], kw["timestep"].dim())),
        with_kwargs=True)
    requests = {"a": (0, params(0, PROMPTS[0], seed=1, steps=3)),
                "b": (1, params(1, PROMPTS[1], seed=2, **NO_GUIDANCE)),
                "c": (1, params(2, PROMPTS[2], seed=3, steps=3, **{**NO_GUIDANCE, "stg_scale": 0.5})),
                "t": (2, text_only(params(prompt=PROMPTS[3], seed=4, **NO_GUIDANCE)))}
    try:
        outputs = run(adapter, requests)
    finally:
        handle.remove()
    # tick 2, main pass: a (uncond, cond), b, c, t in one forward; per-token timesteps throughout
    assert (5, 2) in forwards and {dims for _, dims in forwards} == {2}, forwards
    for name, (_, inputs) in requests.items():
        frames, audio = reference(inputs)
        assert_close_images(outputs[name]["video"], frames, to_uint8)
        assert np.abs(outputs[name]["audio"] - audio).max() <= FLOAT_BOUND, name


@torch.inference_mode()
def test_the_first_frame_stays_the_images_latents_at_timestep_0(adapter):
    state = adapter.new_state("r", parse(adapter, params(steps=3)))
    adapter.prepare_encode(state)
    first = state.condition["latents"]
    tokens = first.shape[1]
    assert first.shape == (1, 16, 4) and state.condition["mask"].shape == (1, 32)  # 4 x 4 of 2 x 4 x 4 tokens
    for _ in range(3):
        timesteps = adapter._token_timesteps(state)
        assert (timesteps[:, :tokens] == 0).all() and (timesteps[:, tokens:] == state.timesteps[state.step_index]).all()
        before = state.latents["video"][:, tokens:].clone()
        adapter.step_scheduler(state, {kind: torch.ones_like(state.latents[kind]) for kind in ("video", "audio")})
        assert torch.equal(state.latents["video"][:, :tokens], first)
        assert not torch.equal(state.latents["video"][:, tokens:], before)


def test_pause_and_resume_equal_the_uninterrupted_run_and_abort_frees_the_condition(adapter, reference):
    """A running image request paused for a more urgent one (one seat) ends as it does alone; its condition
    lives in its state (moved with it by a pause on a GPU), never on the adapter, and an abort frees it."""
    slow = Arrival(0, "slow", parse(adapter, params(0, seed=5, steps=3, **NO_GUIDANCE)), priority=2)
    urgent = Arrival(1, "urgent", parse(adapter, params(1, seed=6, steps=1, **NO_GUIDANCE)), priority=1)
    result = run_arrivals(step_engine(adapter, capacity=1, float_output=True, max_preemptions=1), [slow, urgent])
    assert result.paused == ["slow"]
    np.testing.assert_array_equal(result.images["slow"], reference(slow.params)[0])
    np.testing.assert_array_equal(result.images["urgent"], reference(urgent.params)[0])

    runner = ModelRunner(adapter, float_outputs=True)
    runner.execute_step([DiffusionRequest("r", parse(adapter, params(2)), num_steps=2)], [])
    state = runner.states["r"]
    assert not any(isinstance(v, torch.Tensor) for v in vars(adapter).values())  # nothing on the adapter
    move_tensors(state, torch.device("meta"))  # what a pause on a GPU does (to host memory)
    assert {t.device.type for t in state.condition.values()} == {"meta"}
    gone = weakref.ref(state.condition["latents"])
    del state
    runner.free(["r"])  # an abort
    gc.collect()
    assert gone() is None and not runner.states
