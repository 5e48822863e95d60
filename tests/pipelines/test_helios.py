"""Helios (text to video, chunk by chunk) through the engine's ModelRunner against `HeliosPipeline.__call__`.

Every run goes through the registry's loader and the runner's tick loop; the
reference is the diffusers pipeline on the same tiny weights, called with the
arguments the request stands for (`adapter.pipe_kwargs`).
"""

from __future__ import annotations

import numpy as np
import pytest

from engine_lib.config import ConfigError, EngineConfig
from engine_lib.engine import DiffusionEngine
from engine_lib.interface import to_uint8
from engine_lib.modes import select_mode
from engine_lib.pipelines.helios.adapter import HeliosAdapter
from engine_lib.request import DiffusionRequest, InvalidInputError
from tests.helpers.parity_checks import TEST_CONFIG, Arrival, load_tiny_adapter, parse, pipe_reference, run_steps


@pytest.fixture(scope="module")
def adapter():
    return load_tiny_adapter("helios", HeliosAdapter)


@pytest.fixture(scope="module")
def reference(adapter):
    return pipe_reference(adapter)


def run_solo(adapter, inputs, float_output=True):
    result = run_steps(adapter, [Arrival(0, "solo", inputs)], capacity=1, float_output=float_output)
    return result.images["solo"], result.chunks["solo"]


@pytest.mark.parametrize("inputs", [
    dict(prompt="a cat", seed=3),  # one chunk, CFG on the empty negative prompt (guidance 5)
    dict(prompt="a cat", seed=4, num_frames=65, negative_prompt="blurry", height=32, width=48, num_inference_steps=3),
    dict(prompt="a dog running", seed=5, num_frames=97, guidance_scale=1.0, num_inference_steps=2),  # no CFG
])
def test_the_video_is_the_pipelines_own_and_the_chunks_are_it_end_to_end(adapter, reference, inputs):
    video, chunks = run_solo(adapter, inputs)
    expected = reference(inputs)
    p = parse(adapter, inputs)
    assert video.shape == (1, p.num_frames, p.height, p.width, 3)
    np.testing.assert_array_equal(video, expected)
    np.testing.assert_array_equal(run_solo(adapter, inputs, float_output=False)[0], to_uint8(expected))
    assert [int(c["frame_offset"][0]) for c in chunks] == [33 * k for k in range(adapter.num_chunks(p.num_frames))]
    np.testing.assert_array_equal(np.concatenate([c["video"] for c in chunks], axis=1), video)
    assert all(float(c["frame_rate"][0]) == 24.0 for c in chunks)


def test_a_request_counts_its_steps_over_every_chunk(adapter):
    p = parse(adapter, dict(prompt="x", num_frames=97, num_inference_steps=3))
    assert adapter.total_steps(p) == 9 and DiffusionRequest("r", p, num_steps=adapter.total_steps(p)).num_steps == 9


def test_requests_one_after_another_equal_their_solo_runs(adapter):
    """The runner holds one request at a time; the next one starts from a clean state (own scheduler copy)."""
    cases = [dict(prompt="a cat", seed=1, num_frames=65, num_inference_steps=2),
             dict(prompt="a red car", seed=2, num_inference_steps=3, guidance_scale=1.0)]
    engine = DiffusionEngine.wave(adapter, TEST_CONFIG, 1, float_outputs=True)
    for i, inputs in enumerate(cases):
        final = engine.generate({f"r{i}": parse(adapter, inputs)})[f"r{i}"]
        np.testing.assert_array_equal(final.outputs["video"], run_solo(adapter, inputs)[0])


@pytest.mark.parametrize("num_frames, says", [
    (9, "9 is not a length helios generates (whole chunks of 33 frames); nearest: 33"),
    (34, "34 is not a length helios generates (whole chunks of 33 frames); nearest: 33 or 65"),
    (130, "nearest: 129 or 165"),
    (0, "0 is outside the allowed range [1, 257]"),
    (289, "289 is outside the allowed range [1, 257]"),
])
def test_num_frames_outside_what_helios_generates_is_refused_naming_it(adapter, num_frames, says):
    with pytest.raises(InvalidInputError, match="input 'num_frames'") as info:
        parse(adapter, dict(prompt="x", num_frames=num_frames))
    assert says in str(info.value)


def test_more_than_one_active_request_fails_the_load_naming_max_num_seqs():
    with pytest.raises(ConfigError, match="max_num_seqs=1"):
        select_mode(EngineConfig.of(pipeline="helios", step_execution=True, max_num_seqs=2), HeliosAdapter)
    with pytest.raises(ConfigError, match="'max_num_seqs'=2: helios does not run request batch"):
        select_mode(EngineConfig.of(pipeline="helios", max_num_seqs=2), HeliosAdapter)


def test_progress_responses_follow_preview_interval_between_chunks(adapter):
    result = run_steps(adapter, [Arrival(0, "r", dict(prompt="x", num_frames=65, num_inference_steps=3,
                                                        preview_interval=2))], capacity=1)
    assert [step for step, frames in result.previews["r"]] == [2, 4]  # steps 6 (the end) is the final
    assert all(frames is None for _, frames in result.previews["r"])  # progress only: the chunks carry frames
