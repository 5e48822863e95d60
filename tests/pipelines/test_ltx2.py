"""LTX-2 (text to video with audio) through the engine's ModelRunner against `LTX2Pipeline.__call__`.

Solo requests must be the pipeline's own video bit for bit and its audio within
1e-5; requests batched in one wave (request mode) or joining between steps (step
mode) with different prompts, seeds, step counts and guidance settings each stay
within the batched tolerance of their solo run, with every guidance pass one
forward for all the requests that need it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_lib.engine import DiffusionEngine
from engine_lib.interface import to_uint8
from engine_lib.pipelines.ltx2.adapter import LTX2Adapter
from engine_lib.request import InvalidInputError
from tests.helpers.parity_checks import (FLOAT_BOUND, Arrival, assert_close_images, load_tiny_adapter,
                                         parse, run_steps, run_wave)
from tests.helpers.ltx2_runs import NO_GUIDANCE, run

CASES = {
    "defaults": dict(prompt="a cat", seed=3, height=32, width=32),  # CFG, STG, modality, rescale: every pass
    "longer": dict(prompt="a cat", seed=4, num_frames=17, negative_prompt="blurry", height=32, width=64,
                   num_inference_steps=3, frame_rate=12.0),
    "unguided": dict(prompt="a dog", seed=5, height=32, width=32, **NO_GUIDANCE),
    "stg only": dict(prompt="a red car", seed=6, height=32, width=32, **{**NO_GUIDANCE, "stg_scale": 0.5},
                     guidance_rescale=0.0, audio_guidance_rescale=0.0),
    # an audio scale of 0 takes the video one, as __call__ does
    "audio follows video": dict(prompt="rain", seed=7, height=32, width=32, audio_guidance_scale=0.0,
                                audio_stg_scale=0.0, audio_modality_scale=0.0, audio_guidance_rescale=0.0),
}


@pytest.fixture(scope="module")
def adapter():
    return load_tiny_adapter("ltx2", LTX2Adapter)


def pipe_outputs(adapter, inputs):
    out = adapter.pipe(**adapter.pipe_kwargs(parse(adapter, inputs)), output_type="np")
    return out.frames, out.audio.numpy()


@pytest.mark.parametrize("case", CASES)
def test_a_solo_request_is_the_pipelines_own_video_and_audio(adapter, case):
    frames, audio = pipe_outputs(adapter, CASES[case])
    out = run(adapter, {"solo": (0, CASES[case])})["solo"]
    np.testing.assert_array_equal(out["video"], frames)
    assert out["audio"].shape == audio.shape and np.abs(out["audio"] - audio).max() <= 1e-5
    uint8 = run(adapter, {"solo": (0, CASES[case])}, float_outputs=False)["solo"]
    np.testing.assert_array_equal(uint8["video"], to_uint8(frames))
    p = parse(adapter, CASES[case])
    assert uint8["frame_rate"][0] == p.frame_rate and uint8["audio_sample_rate"][0] == 16000


def _assert_close(out, expected):
    frames, audio = expected
    assert_close_images(out["video"], frames, to_uint8)
    assert np.abs(out["audio"] - audio).max() <= FLOAT_BOUND


def test_step_mode_requests_joining_between_steps_equal_their_solo_runs(adapter):
    """Four requests at their own steps (one joins late) with different guidance: CFG, STG and modality passes
    each batch the requests that need them."""
    same_shape = {k: v for k, v in CASES.items() if k not in ("longer", "audio follows video")}
    requests = {name: (tick, inputs) for tick, (name, inputs) in enumerate(same_shape.items())}
    requests["defaults, 2 steps"] = (1, {**CASES["defaults"], "seed": 9, "num_inference_steps": 2})
    outputs = run(adapter, requests)
    for name, (_, inputs) in requests.items():
        _assert_close(outputs[name], pipe_outputs(adapter, inputs))


def test_request_mode_one_wave_of_different_prompts_and_guidance(adapter):
    waves = [CASES["defaults"], CASES["unguided"], CASES["stg only"]]
    videos = run_wave(adapter, waves, float_output=True)
    for video, inputs in zip(videos, waves):
        assert_close_images(video, pipe_outputs(adapter, inputs)[0], to_uint8)


def test_each_guidance_pass_is_one_forward_over_the_requests_that_need_it(adapter):
    rows = []
    handle = adapter.pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(kwargs["hidden_states"].shape[0]), with_kwargs=True)
    try:
        states = []
        for i, name in enumerate(("defaults", "unguided", "stg only")):
            state = adapter.new_state(f"r{i}", parse(adapter, CASES[name]))
            adapter.prepare_encode(state)
            states.append(state)
        rows.clear()
        from engine_lib.pipelines.base import InputBatch

        with torch.inference_mode():
            adapter.denoise_step(InputBatch.gather(states), states=states)
    finally:
        handle.remove()
    # main pass: 2 + 1 + 1 rows; STG: defaults and "stg only"; modality: defaults only
    assert rows == [4, 2, 1]


@pytest.mark.parametrize("num_frames, says", [
    (10, "10 must be 8k + 1 (the VAE compresses 8 frames into one latent frame); nearest: 9 or 17"),
    (8, "nearest: 1 or 9"),
    (0, "0 is outside the allowed range [1, 257]"),
    (300, "300 is outside the allowed range [1, 257]"),
])
def test_num_frames_off_the_8k_plus_1_grid_is_refused_naming_it(adapter, num_frames, says):
    with pytest.raises(InvalidInputError, match="input 'num_frames'") as info:
        parse(adapter, dict(prompt="x", num_frames=num_frames))
    assert says in str(info.value)


def test_a_video_too_short_for_any_sound_is_refused_naming_num_frames(adapter):
    """1 frame at 120 fps is 8 ms: no audio latent frame, where the pipeline itself would fail reshaping."""
    with pytest.raises(InvalidInputError, match=r"input 'num_frames': 1 frames at frame_rate 120 last 0.008 s, "
                                                r"shorter than 0.020 s, the least that gives the sound one latent frame"):
        parse(adapter, dict(prompt="x", num_frames=1, frame_rate=120.0))
    assert parse(adapter, dict(prompt="x", num_frames=1, frame_rate=24.0)).num_frames == 1  # 0.042 s: one frame


def test_sizes_follow_the_pipelines_multiple_of_32(adapter):
    with pytest.raises(InvalidInputError, match="input 'height': 48 must be a multiple of 32"):
        parse(adapter, dict(prompt="x", height=48))


def test_a_drive_with_previews_sends_progress_only(adapter):
    result = run_steps(adapter, [Arrival(0, "r", dict(CASES["unguided"], num_inference_steps=3,
                                                        preview_interval=1))], capacity=1)
    assert [step for step, frames in result.previews["r"]] == [1, 2]
    assert all(frames is None for _, frames in result.previews["r"])


def test_a_video_over_the_compute_budget_is_refused_naming_its_size(adapter):
    from engine_lib.config import EngineConfig
    from engine_lib.engine import DiffusionEngine

    engine = DiffusionEngine(adapter, EngineConfig.of(pipeline="ltx2", step_execution=True, max_num_seqs=2,
                                                      max_batch_tokens=100, warmup=False))
    try:
        assert engine.parse(dict(prompt="x", height=32, width=32)).num_frames == 9  # 2 x 4 x 4 tokens, x2 CFG
        with pytest.raises(InvalidInputError, match=r"input 'height': 64x64, num_frames=17 needs 384 latent tokens "
                                                    r"per step, more than max_batch_tokens=100"):
            engine.parse(dict(prompt="x", height=64, width=64, num_frames=17))
    finally:
        engine.close()
