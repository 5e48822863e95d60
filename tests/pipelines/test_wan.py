"""Wan text and image to video through the engine's ModelRunner against `WanPipeline` / `WanImageToVideoPipeline`.

Every release shape (tiny presets: Wan2.2 A14B with two experts, Wan2.1, Wan2.2 TI2V-5B; image to
video with and without Wan2.1's CLIP image encoder) is bitwise the pipeline's own video when alone.
In a step batch rows sit on different experts; each expert runs over its own rows, counted here, and
every video stays within one uint8 level of its solo run.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from engine_lib.interface import to_uint8
from engine_lib.pipelines import registry
from engine_lib.request import InvalidInputError
from tests.helpers.lora_checks import assert_within_one_level, diffusers_with_lora
from tests.helpers.parity_checks import (Arrival, load_tiny_adapter, parse, pipe_reference, run_steps, run_wave,
                                         solo_steps)

# 4 steps cross each two-expert preset's boundary: timesteps 999, 973, 923 | 800 (wan, boundary 875) and
# 999, 937 | 833, 625 (wan_i2v, boundary 900)
BASE = dict(prompt="a red kite over the sea", height=32, width=32, num_frames=5, num_inference_steps=4, seed=3,
            guidance_scale=3.5)
PRESETS = [("wan", "tiny"), ("wan", "tiny_2_1"), ("wan", "tiny_ti2v"),
           ("wan_i2v", "tiny"), ("wan_i2v", "tiny_2_1"), ("wan_i2v", "tiny_ti2v")]


def adapter_of(pipeline: str, preset: str):
    """The `tiny` preset through the registry (as served); the other release shapes built in memory."""
    cls = registry.get_adapter_class(pipeline)
    if preset == "tiny":
        return load_tiny_adapter(pipeline, cls)
    pipe = registry.tiny_module(pipeline).build(registry.tiny_module(pipeline).PRESETS[preset], 0)
    pipe.set_progress_bar_config(disable=True)
    return cls(pipe, torch.device("cpu"), torch.float32, {})


@pytest.fixture(scope="module")
def adapters():
    return {}


def get(adapters, pipeline, preset="tiny"):
    if (pipeline, preset) not in adapters:
        adapters[pipeline, preset] = adapter_of(pipeline, preset)
    return adapters[pipeline, preset]


def inputs_for(adapter, **changes) -> dict:
    """BASE (with the low-noise expert's own scale where there is one); a change to None leaves that input out."""
    two_experts = adapter.boundary_timestep is not None
    inputs = {**BASE, **adapter.example_inputs(), **({"guidance_scale_2": 0.7} if two_experts else {}), **changes}
    return {k: v for k, v in inputs.items() if v is not None}


class ExpertRows:
    """The rows each expert's forwards saw, in order ([(expert, rows), ...] per call of `part` of each expert: the
    transformer, or a module of its last block, which a step the first-block cache skips does not call)."""

    def __init__(self, adapter, part=lambda model: model):
        self.forwards: list[tuple[int, int]] = []
        self.handles = [part(model).register_forward_pre_hook(
            lambda module, args, kwargs, k=k: self.forwards.append(
                (k, (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).shape[0])),
            with_kwargs=True) for k, model in enumerate(adapter.experts)]

    def take(self) -> list[tuple[int, int]]:
        taken, self.forwards = self.forwards, []
        return taken

    def close(self):
        for handle in self.handles:
            handle.remove()


@pytest.mark.parametrize("pipeline, preset", PRESETS, ids=[f"{p}-{s}" for p, s in PRESETS])
def test_a_solo_request_is_the_pipelines_own_video(adapters, pipeline, preset):
    adapter = get(adapters, pipeline, preset)
    inputs = inputs_for(adapter)
    expected = pipe_reference(adapter)(inputs)
    rows = ExpertRows(adapter)
    try:
        video = solo_steps(adapter, inputs, float_output=True)
    finally:
        rows.close()
    np.testing.assert_array_equal(video, expected)
    assert video.shape == (1, 5, 32, 32, 3)
    experts = [k for k, _ in rows.forwards]
    # cond and uncond per step: the high-noise expert first, the low-noise one after the boundary
    assert experts == ([0] * 6 + [1] * 2 if (pipeline, preset) == ("wan", "tiny") else
                       [0] * 4 + [1] * 4 if (pipeline, preset) == ("wan_i2v", "tiny") else [0] * 8)


def test_a_solo_request_without_cfg_is_the_pipelines_own_uint8_video(adapters):
    adapter = get(adapters, "wan")
    inputs = inputs_for(adapter, guidance_scale=1.0, num_frames=9, height=48, seed=7)
    np.testing.assert_array_equal(solo_steps(adapter, inputs), to_uint8(pipe_reference(adapter)(inputs)))


@pytest.mark.parametrize("pipeline", ["wan", "wan_i2v"])
def test_three_requests_joining_at_different_ticks_on_different_experts_match_their_solo_runs(adapters, pipeline):
    """Joining at ticks 0, 1, 2, the three are on different steps, so some ticks hold rows of both experts: each
    expert runs over exactly its own rows, and every video is within 1 uint8 level of its solo run."""
    adapter = get(adapters, pipeline)
    cases = {"a": inputs_for(adapter),
             "b": inputs_for(adapter, prompt="a green field", seed=4, guidance_scale=5.0, guidance_scale_2=None),
             "c": inputs_for(adapter, prompt="rain", seed=5, guidance_scale=1.0, num_inference_steps=3)}
    rows = ExpertRows(adapter)
    try:
        mixed = run_steps(adapter, [Arrival(i, rid, p) for i, (rid, p) in enumerate(cases.items())], capacity=3)
    finally:
        rows.close()
    assert max(mixed.forward_sizes) == 3, "all three shared ticks"
    assert (1, 1) in rows.forwards and (0, 2) in rows.forwards, rows.forwards  # a tick of both experts
    for rid, inputs in cases.items():
        levels = np.abs(mixed.images[rid].astype(int) - solo_steps(adapter, inputs).astype(int))
        assert levels.max() <= 1, (rid, levels.max())


def test_request_mode_runs_a_wave_of_different_prompts_and_guidance_within_one_level_of_solo(adapters):
    adapter = get(adapters, "wan_i2v")
    wave = [inputs_for(adapter), inputs_for(adapter, prompt="a green field", seed=4, guidance_scale=6.5)]
    for video, inputs in zip(run_wave(adapter, wave), wave):
        assert np.abs(video.astype(int) - solo_steps(adapter, inputs).astype(int)).max() <= 1


def test_a_drive_with_previews_sends_progress_only(adapters):
    adapter = get(adapters, "wan")
    result = run_steps(adapter, [Arrival(0, "r", inputs_for(adapter, num_inference_steps=3, preview_interval=1))],
                         capacity=1)
    assert [step for step, frames in result.previews["r"]] == [1, 2]
    assert all(frames is None for _, frames in result.previews["r"])


@pytest.mark.parametrize("pipeline, preset, inputs, says", [
    ("wan", "tiny", dict(num_frames=10), "input 'num_frames': 10 must be 4k + 1 (the VAE compresses 4 frames into "
                                         "one latent frame); nearest: 9 or 13"),
    ("wan", "tiny", dict(num_frames=0), "input 'num_frames': 0 is outside the allowed range [1, 257]"),
    ("wan", "tiny", dict(num_frames=258), "input 'num_frames': 258 is outside the allowed range [1, 257]"),
    ("wan", "tiny", dict(height=40), "input 'height': 40 must be a multiple of 16"),
    ("wan", "tiny", dict(guidance_scale_2=-0.3), "input 'guidance_scale_2': -0.3 must be a finite number in [0, 100]"),
    ("wan", "tiny_2_1", dict(guidance_scale_2=0.6), "input 'guidance_scale_2': wan does not use this input: this "
                                                    "checkpoint has one transformer (no boundary_ratio)"),
    ("wan", "tiny_ti2v", dict(height=48), "input 'height': 48 must be a multiple of 32"),
    ("wan_i2v", "tiny", dict(image=None), "input 'image': is required"),
    ("wan_i2v", "tiny", dict(image=b"GIF89a not an image"), "input 'image': is not a PNG, JPEG or WebP file"),
])
def test_hostile_inputs_are_refused_naming_the_input(adapters, pipeline, preset, inputs, says):
    adapter = get(adapters, pipeline, preset)
    with pytest.raises(InvalidInputError) as info:
        parse(adapter, inputs_for(adapter, **inputs))
    assert says in str(info.value)


def test_loras_per_row_on_both_experts_match_diffusers_and_their_solo_runs(adapters):
    """A LoRA (on every layer of `transformer`, where diffusers' Wan loader puts it) alone is bitwise diffusers'
    `set_adapters`; with other LoRAs and none, joining at different ticks on different experts, each row keeps its
    own LoRA within its expert's forward and every video is within 1 level of its solo run."""
    from engine_lib.pipelines.tiny_models import ensure_loras

    adapter = get(adapters, "wan")
    lora_dir = ensure_loras("wan", registry.default_model_dir("wan"))
    config = adapter.config.replace(lora_dir=str(lora_dir))
    lora = type(adapter)(adapter.pipe, adapter.device, adapter.dtype, config)
    inputs = inputs_for(lora, lora_name="toy_all", lora_scale=0.6)
    alone = solo_steps(lora, inputs)
    expected = diffusers_with_lora(lora, registry.default_model_dir("wan"), lora_dir, "toy_all", 0.6, inputs)
    np.testing.assert_array_equal(alone, to_uint8(expected))
    assert not np.array_equal(alone, solo_steps(lora, inputs_for(lora))), "the LoRA changes the video"
    cases = {"all": inputs, "none": inputs_for(lora, seed=8), "b": inputs_for(lora, lora_name="toy_b", seed=9)}
    mixed = run_steps(lora, [Arrival(i, rid, p) for i, (rid, p) in enumerate(cases.items())], capacity=3)
    assert max(mixed.forward_sizes) == 3
    for rid, p in cases.items():
        assert_within_one_level(mixed.images[rid], solo_steps(lora, p), rid)


def test_the_first_block_cache_is_diffusers_hook_on_each_expert_and_shares_a_step_batch(adapters):
    """Alone: the decisions (rows into each expert's last block) and the video of diffusers' FirstBlockCache hook
    on both transformers, bitwise; each expert keeps its own residuals, so its first step computes. Then a cached
    request, one without the cache and one cached at another threshold without CFG, joining at ticks 0, 1, 2, each
    within 1 level of its solo run, with fewer rows through the last blocks than without the cache."""
    from tests.helpers.step_cache_checks import diffusers_cache

    adapter = get(adapters, "wan")
    cached = inputs_for(adapter, num_inference_steps=6, cache="first_block", cache_threshold=0.1)
    tails = ExpertRows(adapter, part=lambda model: model.blocks[-1].ffn)  # (the hook's skipped blocks are called)
    try:
        ours = solo_steps(adapter, cached, float_output=True)
        ours_rows = tails.take()
        with contextlib.ExitStack() as hooks:
            for model in adapter.experts:
                hooks.enter_context(diffusers_cache(model, 0.1))
            expected = pipe_reference(adapter)(cached)
        assert ours_rows == tails.take() and len(ours_rows) < 12, ours_rows  # 6 steps x cond, uncond
        assert {k for k, _ in ours_rows} == {0, 1}
        np.testing.assert_array_equal(ours, expected)
        cases = {"cached": cached, "plain": inputs_for(adapter, num_inference_steps=6, seed=4),
                 "cached-0.3": inputs_for(adapter, num_inference_steps=5, seed=5, guidance_scale=1.0,
                                          cache="first_block", cache_threshold=0.3)}
        mixed = run_steps(adapter, [Arrival(i, rid, p) for i, (rid, p) in enumerate(cases.items())], capacity=3)
        rows_together = sum(n for _, n in tails.take())
        assert max(mixed.forward_sizes) == 3
        alone = {rid: solo_steps(adapter, p) for rid, p in cases.items()}
        assert rows_together < 6 * 2 + 6 * 2 + 5, "the cached requests skipped blocks in the shared batch"
    finally:
        tails.close()
    for rid in cases:
        levels = np.abs(mixed.images[rid].astype(int) - alone[rid].astype(int))
        assert levels.max() <= 1, (rid, levels.max())
