"""Sequence-parallel Qwen-Image (with true CFG) and Flux: each forward's image and text tokens split over two CPU
worker processes over gloo (Ulysses attention), against the single-process adapter on the tiny models, with per-row
LoRAs and both step caches.

One worker group per pipeline serves the module. The ranks attend over the joint sequence in another token order
(each rank's text then image tokens), so the sums differ from the single-process ones in their last bits: the
bound is LATENT_BOUND, not equality.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from engine_lib.interface import to_uint8
from engine_lib.pipelines import rank_states
from engine_lib.pipelines.flux.adapter import FluxAdapter
from engine_lib.pipelines.qwen_image.adapter import QwenImageAdapter
from engine_lib.request import InvalidInputError
from tests.helpers.parity_checks import load_tiny_adapter, parse, step_latents, with_cfg_batching
from tests.helpers.rank_checks import CFG, LATENT_BOUND, sequence_parallel
from tests.helpers.step_cache_checks import (cached_inputs, diffusers_cache, head_and_tail, hook_decisions, rank_rows,
                                             rows_through)

TAYLORSEER_BOUND = 2e-4  # rows that predict with TaylorSeer (measured: 1.5e-4 for Qwen-Image)


@pytest.fixture(scope="module")
def qwen() -> QwenImageAdapter:
    return load_tiny_adapter("qwen_image", QwenImageAdapter)


@pytest.fixture(scope="module")
def qwen_sp():
    yield from sequence_parallel("qwen_image")


@pytest.fixture(scope="module")
def flux() -> FluxAdapter:
    return load_tiny_adapter("flux", FluxAdapter)


@pytest.fixture(scope="module")
def flux_sp():
    yield from sequence_parallel("flux")


def assert_same_run(parallel, single, arrivals):
    """Every step's latents within LATENT_BOUND of the single-process run's (TaylorSeer's rows: TAYLORSEER_BOUND),
    its images within 1 uint8 level, the same step cache decisions (counted by the driver as one process counts
    its own); the ranks ran every tick (and freed each caching request's state), and hold no request state after
    it."""
    calls = parallel.workers.calls
    ranks, one = Counter(parallel.cache_steps), Counter(single.cache_steps)
    latents, images = step_latents(parallel, arrivals)
    ticks = parallel.workers.calls - calls
    expected_latents, expected_images = step_latents(single, arrivals)
    assert parallel.cache_steps - ranks == single.cache_steps - one
    for rid, (_, p) in arrivals.items():
        bound = TAYLORSEER_BOUND if p.cache == "taylorseer" else LATENT_BOUND
        assert np.abs(latents[rid] - expected_latents[rid]).max() <= bound, rid
        levels = np.abs(to_uint8(images[rid]).astype(int) - to_uint8(expected_images[rid]).astype(int))
        assert levels.max() <= 1, rid
    frees = sum(rank_states.caches(p) for _, p in arrivals.values())
    assert ticks == max(at + p.num_inference_steps for at, p in arrivals.values()) + frees
    assert parallel.workers.call_all("held_states", [()] * 2) == [0, 0]


def joining_batch(single, **inputs) -> dict:
    """Three requests joining at ticks 0, 1 and 2, with different prompts (text lengths) and step counts."""
    return {f"r{i}": (i, parse(single, dict(prompt=prompt, num_inference_steps=steps, seed=i, **inputs)))
            for i, (prompt, steps) in enumerate([("a cat", 3), ("a red car on a long road", 2), ("fruit", 3)])}


def test_qwen_image_with_true_cfg_solo_and_with_an_odd_token_count_equals_the_single_process_run(qwen_sp, qwen):
    """24x24 pixels: 9 image tokens, 5 on rank 0 and 4 on rank 1."""
    arrivals = {"solo": (0, parse(qwen, dict(prompt="a red cube", num_inference_steps=2, seed=5, **CFG))),
                "odd": (0, parse(qwen, dict(prompt="a red cube", num_inference_steps=2, seed=5, height=24, width=24,
                                            **CFG)))}
    for rid, arrival in arrivals.items():
        assert_same_run(qwen_sp, qwen, {rid: arrival})


def test_qwen_image_with_true_cfg_in_a_step_batch_joined_at_different_ticks_equals_the_single_process_run(
        qwen_sp, qwen):
    assert_same_run(qwen_sp, qwen, joining_batch(qwen, **CFG))


def test_qwen_image_with_true_cfg_as_two_forwards_equals_the_single_process_run(qwen_sp, qwen):
    """cfg_batching off: the ranks run the cond and the uncond forward one after the other, as the driver would."""
    p = parse(qwen, dict(prompt="a red cube", num_inference_steps=2, seed=5, **CFG))
    qwen_sp.cfg_batching = False
    try:
        assert_same_run(qwen_sp, with_cfg_batching(qwen, False), {"solo": (0, p)})
    finally:
        qwen_sp.cfg_batching = True


def test_flux_solo_and_in_a_step_batch_joined_at_different_ticks_equals_the_single_process_run(flux_sp, flux):
    assert_same_run(flux_sp, flux, {"solo": (0, parse(flux, dict(prompt="a red cube", num_inference_steps=2,
                                                                  seed=5)))})
    assert_same_run(flux_sp, flux, joining_batch(flux, max_sequence_length=7))  # 7 text tokens: 4 and 3


def mixed_loras(single, **inputs) -> dict:
    """A joining batch whose rows run under two LoRAs (one at scale 0.7, two images) and none."""
    batch = joining_batch(single, **inputs)
    loras = [dict(lora_name="toy_a", lora_scale=0.7, num_images=2), dict(lora_name="toy_b"), {}]
    return {rid: (at, parse(single, {**p, **lora})) for (rid, (at, p)), lora in zip(batch.items(), loras)}


@pytest.mark.parametrize("pipeline", ["qwen_image", "flux"])
def test_mixed_loras_in_a_step_batch_joined_at_different_ticks_equal_the_single_process_run(pipeline, request):
    """Each row's LoRA on every rank's share of its tokens (Qwen-Image with true CFG in one forward of 2B rows)."""
    single, parallel = request.getfixturevalue(pipeline.split("_")[0]), request.getfixturevalue(
        pipeline.split("_")[0] + "_sp")
    inputs = CFG if pipeline == "qwen_image" else dict(max_sequence_length=7)
    assert_same_run(parallel, single, mixed_loras(single, **inputs))


@pytest.mark.parametrize("pipeline", ["qwen_image", "flux"])
def test_step_caches_next_to_plain_rows_under_mixed_loras_equal_the_single_process_run(pipeline, request):
    """Each rank keeps the first block's residuals and the TaylorSeer factors of its share of the tokens; the
    first-block cache decides over every rank's tokens (the sums of the residual change all-reduced), so every
    rank decides as one process does and skips the blocks one process skips (rows through the head and tail
    blocks counted on each rank). TaylorSeer extrapolates from the differences of its last computed steps, so
    the ranks' last-bit differences (their token order: the other rows stay within LATENT_BOUND) grow about
    tenfold in its rows: within TAYLORSEER_BOUND there, images within 1 level."""
    single, parallel = request.getfixturevalue(pipeline.split("_")[0]), request.getfixturevalue(
        pipeline.split("_")[0] + "_sp")
    inputs = CFG if pipeline == "qwen_image" else dict(max_sequence_length=7)
    batch = mixed_loras(single, **inputs)
    caches = [dict(cache="first_block", cache_threshold=0.6), dict(cache="taylorseer"), {}]
    arrivals = {rid: (at, parse(single, {**p, "num_inference_steps": 6, **cache}))
                for (rid, (at, p)), cache in zip(batch.items(), caches)}
    one, names = Counter(single.cache_steps), head_and_tail(single)
    before = rank_rows(parallel, names)
    with rows_through(single, names) as rows:
        assert_same_run(parallel, single, arrivals)
    one = single.cache_steps - one
    assert one["reused"] >= 2, one  # each kind of cache reused steps
    head, tail = names  # the block evaluations the first-block cache skipped, on every rank as in one process
    assert rows[head] > rows[tail]
    ran = [{name: now[name] - then[name] for name in names} for now, then in zip(rank_rows(parallel, names), before)]
    assert ran == [rows] * 2


def test_first_block_decisions_at_the_edge_are_made_over_every_rank_s_tokens(qwen_sp, qwen):
    """Thresholds at 0.999 and 1.001 times the second step's change over the whole sequence (as diffusers' hook
    measures it in one process): the ranks compute, then reuse, that step as one process does. Each rank's own
    share of the tokens changes more or less than the whole, so ranks that decided from their share alone would
    decide differently at one of them (they refuse to: the call fails)."""
    base = {"prompt": "a cat", "num_inference_steps": 3, "height": 64, "width": 64, "seed": 3}
    p = parse(qwen, cached_inputs(base, 0.0))
    with hook_decisions() as measured, diffusers_cache(qwen.pipe.transformer, 0.0):
        qwen.pipe(**qwen.pipe_kwargs(p), output_type="np")
    edge = measured[0][0]
    for scale, reused in ((0.999, 0), (1.001, 1)):
        one = Counter(qwen.cache_steps)
        assert_same_run(qwen_sp, qwen, {"edge": (0, parse(qwen, cached_inputs(base, float(np.float32(edge * scale)))))})
        assert (qwen.cache_steps - one)["reused"] == reused, scale


def test_what_the_ranks_cannot_run_is_refused_naming_the_input(qwen_sp):
    refused = {"max_sequence_length": dict(max_sequence_length=1), "height": dict(height=8, width=8)}
    for name, inputs in refused.items():
        with pytest.raises(InvalidInputError) as info:
            parse(qwen_sp, dict(prompt="x", num_inference_steps=2, **inputs))
        assert info.value.input_name == name and "sequence_parallel_size=2" in str(info.value)
    # (what sequence parallel does not combine with, and the pipelines without it: test_capabilities.py)
