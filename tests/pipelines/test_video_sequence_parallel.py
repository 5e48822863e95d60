"""Sequence-parallel LTX-2 and Helios: each transformer call's tokens split over two CPU worker processes over gloo
(Ulysses attention through the models' context-parallel plans), against the single-process adapter on the tiny
models.

Token counts are odd where the tiny models allow it, so the ranks' shares differ in size: LTX-2's 7 text tokens (4
and 3; its video tokens, 4x4 per 32x32 pixels of a latent frame, are even), Helios' 27 chunk tokens (14 and 13).
The ranks attend over the same tokens in the same order, but LTX-2's attention sums run over the text split in two
and over the audio tokens twice (every rank holds them all), so its latents differ from the single process's in
their last bits: LATENT_BOUND, not equality (Helios' measured equal).
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from diffusers.configuration_utils import FrozenDict

from engine_lib.config import ConfigError
from engine_lib.interface import to_uint8
from engine_lib.pipelines.base import InputBatch
from engine_lib.pipelines.helios.adapter import HeliosAdapter
from engine_lib.pipelines.ltx2.adapter import LTX2Adapter
from engine_lib.request import InvalidInputError
from tests.helpers.parity_checks import load_tiny_adapter, parse, run_wave
from tests.helpers.ltx2_runs import NO_GUIDANCE, png
from tests.helpers.rank_checks import sequence_parallel

LATENT_BOUND = 1e-5
LTX2_SIZE = dict(height=96, width=32, num_frames=17, max_sequence_length=7)  # 3 latent frames of 12x4 tokens
HELIOS_SIZE = dict(height=16, width=48, num_frames=65)  # 2 chunks of 9 latent frames of 1x3 tokens (2x2 patches)


@pytest.fixture(scope="module")
def ltx2() -> LTX2Adapter:
    return load_tiny_adapter("ltx2", LTX2Adapter)


@pytest.fixture(scope="module")
def ltx2_sp():
    yield from sequence_parallel("ltx2")


@pytest.fixture(scope="module")
def helios() -> HeliosAdapter:
    return load_tiny_adapter("helios", HeliosAdapter)


@pytest.fixture(scope="module")
def helios_sp():
    yield from sequence_parallel("helios")


def latents_of(state) -> dict:
    latents = state.latents if isinstance(state.latents, dict) else {"video": state.latents}
    return {kind: tensor.clone() for kind, tensor in latents.items()}


@torch.inference_mode()
def run_ticks(adapter, arrivals: dict) -> tuple[dict, dict]:
    """The step contract tick by tick, as the runner calls it (`arrivals`: request id -> (tick, params)): each
    request's latents after every step (by kind: video, audio) and its final video."""
    states, latents, videos, tick = {}, {}, {}, 0
    while len(videos) < len(arrivals):
        for rid, (at, p) in arrivals.items():
            if at == tick:
                states[rid] = adapter.new_state(rid, p)
                adapter.prepare_encode(states[rid])
        active = [s for s in states.values() if not s.denoise_completed]
        batch = InputBatch.gather(active)
        for state, prediction in zip(active, batch.split(adapter.denoise_step(batch, states=active))):
            adapter.step_scheduler(state, prediction)
            adapter.chunk_outputs(state)
            latents.setdefault(state.request_id, []).append(latents_of(state))
        done = [s for s in active if s.denoise_completed]
        for state, out in zip(done, adapter.post_decode(done) if done else []):
            videos[state.request_id] = out["video"]
        tick += 1
    return latents, videos


def assert_same_run(parallel, single, arrivals):
    """Every step's latents within LATENT_BOUND of the single-process run's, its video within 1 uint8 level; the
    ranks ran every transformer call the single process ran (one call each)."""
    calls = []
    handle = single.pipe.transformer.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        expected_latents, expected_videos = run_ticks(single, arrivals)
    finally:
        handle.remove()
    before = parallel.workers.calls
    latents, videos = run_ticks(parallel, arrivals)
    assert parallel.workers.calls - before == len(calls) > 0
    for rid in arrivals:
        assert len(latents[rid]) == len(expected_latents[rid]) == parallel.total_steps(arrivals[rid][1])
        for step, expected in zip(latents[rid], expected_latents[rid]):
            for kind in expected:
                assert (step[kind] - expected[kind]).abs().max() <= LATENT_BOUND, (rid, kind)
        levels = np.abs(to_uint8(videos[rid]).astype(int) - to_uint8(expected_videos[rid]).astype(int))
        assert videos[rid].shape == expected_videos[rid].shape and levels.max() <= 1, rid


def test_ltx2_solo_with_every_guidance_pass_equals_the_single_process_run(ltx2_sp, ltx2):
    """CFG on a negative prompt, STG and modality isolation: three transformer calls a step, each on the ranks."""
    p = parse(ltx2, dict(prompt="a cat", negative_prompt="blurry", seed=3, num_inference_steps=2, guidance_scale=3.3,
                         **LTX2_SIZE))
    assert_same_run(ltx2_sp, ltx2, {"solo": (0, p)})


def test_ltx2_step_batch_joined_at_different_ticks_with_an_image_request_equals_the_single_process_run(
        ltx2_sp, ltx2):
    """Three requests join at ticks 0, 1 and 2: every guidance pass, none, and an image request with STG only (its
    per-token timesteps, 0 on the image's frame, split with the tokens)."""
    requests = [dict(prompt="a cat", seed=1, num_inference_steps=3),
                dict(prompt="a red car on a long road", seed=2, num_inference_steps=2, **NO_GUIDANCE),
                dict(prompt="fruit", seed=4, num_inference_steps=2, image=png(40, 56),
                     **{**NO_GUIDANCE, "stg_scale": 0.6})]
    assert_same_run(ltx2_sp, ltx2, {f"r{i}": (i, parse(ltx2, {**inputs, **LTX2_SIZE}))
                                    for i, inputs in enumerate(requests)})


def test_ltx2_request_mode_wave_equals_the_single_process_run(ltx2_sp, ltx2):
    """Request batching: two requests admitted together, run to completion through the runner (the main pass of
    three rows, the STG and modality passes of one), each video within 1 uint8 level of one process's."""
    wave = [dict(prompt="a cat", seed=7, num_inference_steps=2, guidance_scale=2.6, **LTX2_SIZE),
            dict(prompt="rain on a roof", seed=8, num_inference_steps=2, **NO_GUIDANCE, **LTX2_SIZE)]
    before = ltx2_sp.workers.calls
    for video, expected in zip(run_wave(ltx2_sp, wave, float_output=True), run_wave(ltx2, wave, float_output=True)):
        assert video.shape == expected.shape and np.abs(to_uint8(video).astype(int) -
                                                        to_uint8(expected).astype(int)).max() <= 1
    assert ltx2_sp.workers.calls - before == 2 * 3  # two steps of three passes, each one call on the ranks


def test_helios_two_chunks_with_cfg_then_one_without_equal_the_single_process_run(helios_sp, helios):
    """Helios runs one request at a time (max_step_batch 1): two chunks with CFG (cond and uncond calls), then a
    request without CFG on the same ranks."""
    first = parse(helios, dict(prompt="a cat", negative_prompt="blurry", seed=4, guidance_scale=4.6,
                               num_inference_steps=2, **HELIOS_SIZE))
    assert_same_run(helios_sp, helios, {"cfg": (0, first)})
    second = parse(helios, dict(prompt="a dog running", seed=5, guidance_scale=1.0, num_inference_steps=3,
                                height=32, width=48))
    assert_same_run(helios_sp, helios, {"no cfg": (0, second)})


def test_what_the_ltx2_ranks_cannot_split_is_refused_naming_the_input(ltx2_sp, ltx2):
    """Every rank takes at least one text and one video token. The tiny VAE's 16 tokens of the smallest video
    (32x32, one frame) are fewer than 32 ranks' (the shipped VAE's 32x32 pixels are one token)."""
    with pytest.raises(InvalidInputError) as info:
        parse(ltx2_sp, dict(prompt="x", num_inference_steps=2, max_sequence_length=1))
    assert info.value.input_name == "max_sequence_length" and "at least 2 with sequence_parallel_size=2" in str(
        info.value)
    assert parse(ltx2_sp, dict(prompt="x", num_inference_steps=2, max_sequence_length=2)).max_sequence_length == 2
    with mock.patch.object(ltx2, "config", ltx2.config.replace(sequence_parallel_size=32)), \
            mock.patch.object(ltx2, "workers", object()):
        with pytest.raises(InvalidInputError) as info:
            parse(ltx2, dict(prompt="x", num_inference_steps=2, height=32, width=32, num_frames=1,
                             max_sequence_length=32))
    assert info.value.input_name == "height" and "at least 32 latent tokens with sequence_parallel_size=32" in str(
        info.value)


def test_a_helios_checkpoint_that_amplifies_its_history_is_refused_sequence_parallel(helios):
    """Where its history keys end is counted from the forward's tokens, of which a rank holds a share."""
    amplifying = FrozenDict({**helios.pipe.transformer.config, "is_amplify_history": True})
    with mock.patch.object(helios.pipe.transformer, "_internal_dict", amplifying), \
            mock.patch.object(helios, "config", helios.config.replace(sequence_parallel_size=2)):
        with pytest.raises(ConfigError, match="'sequence_parallel_size'=2: this Helios checkpoint amplifies"):
            helios.start_workers("unused")
