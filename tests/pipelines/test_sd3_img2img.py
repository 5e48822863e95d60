"""SD3 image-to-image (`image`, `strength`) against `StableDiffusion3Img2ImgPipeline` on the tiny pipeline (CPU,
float32): solo runs bitwise, requests with different images, strengths and prompts in one step batch each
within a uint8 level of its solo run, the encoded image in the request's own state (freed, moved, kept
across a pause)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3Img2ImgPipeline

from engine_lib.config import EngineConfig
from engine_lib.engine import DiffusionEngine
from engine_lib.interface import to_uint8
from engine_lib.pipelines.base import move_tensors
from engine_lib.pipelines.flow_match import strength_steps
from engine_lib.pipelines.sd3.adapter import SD3Adapter
from engine_lib.request import DiffusionRequest, InvalidInputError
from engine_lib.runner import ModelRunner
from tests.helpers.parity_checks import (PROMPTS, Arrival, load_tiny_adapter, parse, run_arrivals, run_steps,
                                         solo_steps, step_batched_then_alone, step_engine)
from tests.helpers.sd3_img2img_inputs import params

@pytest.fixture(scope="module")
def adapter() -> SD3Adapter:
    return load_tiny_adapter("sd3", SD3Adapter)


@pytest.fixture(scope="module")
def img2img(adapter):
    """diffusers' image-to-image pipeline on the very same components."""
    pipe = StableDiffusion3Img2ImgPipeline(**adapter.pipe.components)
    pipe.set_progress_bar_config(disable=True)
    return lambda inputs: pipe(**adapter.pipe_kwargs(parse(adapter, inputs)), output_type="np").images


@pytest.mark.parametrize("inputs", [
    params(),
    params(image=1, strength=0.5, guidance_scale=5.0, negative_prompt="blurry", num_images=2, seed=4),
    params(image=2, strength=1.0, steps=3),
], ids=["strength-0.6", "cfg-two-images", "strength-1"])
def test_solo_matches_diffusers_img2img_bitwise(adapter, img2img, inputs):
    expected = img2img(inputs)
    np.testing.assert_array_equal(solo_steps(adapter, inputs, float_output=True), expected)
    np.testing.assert_array_equal(solo_steps(adapter, inputs), to_uint8(expected))


def test_strength_runs_the_tail_of_the_schedule(adapter):
    """steps - int(steps * (1 - strength)) steps, as get_timesteps counts them (2.5 runs 3), each at the
    timestep diffusers runs it."""
    assert [adapter.total_steps(parse(adapter, params(strength=s, steps=5))) for s in (0.2, 0.4, 0.5, 1.0)] == \
        [1, 2, 3, 5]
    state = adapter.new_state("r", parse(adapter, params(strength=0.6, steps=5)))
    adapter.prepare_encode(state)
    full = adapter.new_state("t", parse(adapter, {k: v for k, v in params(steps=5).items()
                                                  if k not in ("image", "strength")}))
    adapter.prepare_encode(full)
    assert state.num_steps == 3 and state.begin_index == 2 and full.num_steps == 5
    assert torch.equal(state.schedule.phases[0], full.schedule.phases[0][2:])


def test_a_request_counts_its_steps_once(adapter):
    """strength -> steps runs once per request: validation at parse, the request's `num_steps` at admission (its
    state takes it) and its request-mode wave key all read that one count."""
    engine = DiffusionEngine(adapter, EngineConfig.of(max_num_seqs=2, warmup=False), run_loop=False)
    strength_steps.cache_clear()
    engine.add_request("r", engine.parse(params(strength=0.45, steps=7, seed=11)))  # 3.15 of 7: the last 4 run
    assert strength_steps.cache_info().misses == 1
    assert engine.scheduler.get_request("r").num_steps == 4
    plan, out = engine.step()
    assert plan.new_ids == ["r"] and out.step_index == {"r": 1} and engine.runner.states["r"].num_steps == 4
    while engine.scheduler.has_requests:
        engine.step()
    assert strength_steps.cache_info().misses == 1


def test_validation(adapter):
    text = {k: v for k, v in params().items() if k != "image"}
    with pytest.raises(InvalidInputError, match="input 'strength': needs an image"):
        parse(adapter, text)  # an input accepted but ignored would silently be text-to-image
    for none in (0.0, 1e-17):
        with pytest.raises(InvalidInputError, match=f"input 'strength': {none:g} of 5 steps runs none"):
            parse(adapter, params(strength=none))
    with pytest.raises(InvalidInputError, match="input 'image': is not a PNG"):
        parse(adapter, params(image=0) | {"image": b"not an image"})
    for bad in (-0.5, 1.5, float("nan")):
        with pytest.raises(InvalidInputError, match="input 'strength'"):
            parse(adapter, params(strength=bad))


def test_image_and_strength_never_split_a_batch(adapter):
    one, other = parse(adapter, params()), parse(adapter, params(image=1, strength=0.4, seed=9))
    text = parse(adapter, {k: v for k, v in params().items() if k not in ("image", "strength")})
    assert adapter.step_key(one) == adapter.step_key(other) == adapter.step_key(text)
    # a request-mode wave runs one step count: the steps that run (3, 2 and 5 of 5)
    assert len({adapter.request_key(p) for p in (one, other, text)}) == 3


@torch.inference_mode()
def test_a_cut_schedule_steps_on_alone_after_batched_steps(adapter):
    """After batched Euler steps each request's own scheduler stands where its cut schedule is (its begin plus
    the steps done), so a later per-request step (a ragged or failed batch) uses the right sigma."""
    def prepared():
        states = []
        for i, strength in enumerate((0.6, 0.8)):
            state = adapter.new_state(f"r{i}", parse(adapter, params(image=i, strength=strength, seed=i)))
            adapter.prepare_encode(state)
            states.append(state)
        return states

    batched, alone = prepared(), prepared()
    step_batched_then_alone(adapter, batched, alone)
    assert [s.begin_index for s in batched] == [2, 1]
    for b, a in zip(batched, alone):
        assert torch.equal(b.latents, a.latents)


def test_step_batch_of_different_images_strengths_and_prompts_matches_solo(adapter):
    """Three image-to-image requests and a text-to-image one join at different ticks, each row at its own
    timestep of its own cut schedule: each within a uint8 level of its solo run."""
    arrivals = [Arrival(0, "a", params(0, 0.6, PROMPTS[0], seed=1)),
                Arrival(1, "b", params(1, 1.0, PROMPTS[1], seed=2)),
                Arrival(1, "c", params(2, 0.4, PROMPTS[2], seed=3)),
                Arrival(2, "t", {k: v for k, v in params(prompt=PROMPTS[3], seed=4).items()
                                 if k not in ("image", "strength")})]
    result = run_steps(adapter, arrivals, capacity=4)
    assert max(result.forward_sizes) == 4, result.forward_sizes
    assert result.finished_at == {"a": 2, "c": 2, "b": 5, "t": 6}  # 3, 2, 5 and 5 steps
    for a in arrivals:
        solo = solo_steps(adapter, a.params)
        levels = np.abs(result.images[a.request_id].astype(np.int16) - solo.astype(np.int16))
        assert levels.max() <= 1, (a.request_id, levels.max())
    assert np.abs(result.images["a"].astype(int) - result.images["c"].astype(int)).max() > 10  # own images


def test_the_encoded_image_lives_in_the_state_and_is_freed_on_abort(adapter):
    runner = ModelRunner(adapter)
    request = DiffusionRequest("r", parse(adapter, params()), num_steps=3)
    runner.execute_step([request], [])
    state = runner.states["r"]
    assert state.image_latents.shape == state.latents.shape
    assert not any(isinstance(v, torch.Tensor) for v in vars(adapter).values())  # nothing on the adapter
    move_tensors(state, torch.device("meta"))  # a pause on a GPU moves it with the latents
    assert state.image_latents.device.type == "meta" and state.latents.device.type == "meta"
    gone = weakref.ref(state.image_latents)
    del state
    runner.free(["r"])  # an abort
    gc.collect()
    assert gone() is None and not runner.states


def test_pause_and_resume_equal_the_uninterrupted_run(adapter):
    """A running image-to-image request paused for a more urgent one (one seat) ends as it does alone."""
    slow = Arrival(0, "slow", parse(adapter, params(strength=0.8)), priority=2)
    urgent = Arrival(2, "urgent", parse(adapter, params(image=1, seed=5, steps=2, strength=1.0)), priority=1)
    result = run_arrivals(step_engine(adapter, capacity=1, max_preemptions=1), [slow, urgent])
    assert result.paused == ["slow"]
    np.testing.assert_array_equal(result.images["slow"], solo_steps(adapter, slow.params))
    np.testing.assert_array_equal(result.images["urgent"], solo_steps(adapter, urgent.params))
