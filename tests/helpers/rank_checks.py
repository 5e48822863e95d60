"""Parallel ranks against one process on the tiny models: a sequence-parallel adapter of two CPU ranks, and the
CFG-parallel checks (every step's latents, the images, the ticks the ranks ran, the step caches' decisions)
shared by the Qwen-Image and Flux tests."""

from __future__ import annotations

from collections import Counter

import numpy as np

from engine_lib.config import EngineConfig
from engine_lib.interface import to_uint8
from engine_lib.pipelines import rank_states
from engine_lib.pipelines.registry import load_adapter
from engine_lib.pipelines.tiny_models import ensure_model
from tests.helpers.parity_checks import parse, step_latents

LATENT_BOUND = 1e-5
CFG = dict(negative_prompt="blurry", true_cfg_scale=4.0)


def sequence_parallel(pipeline: str):
    adapter = load_adapter(EngineConfig.of(pipeline=pipeline, model_path=str(ensure_model(pipeline, "tiny")),
                                           device="cpu", dtype="float32", sequence_parallel_size=2))
    yield adapter
    adapter.close()


def assert_same_run(parallel, single, two_forwards, arrivals, exact=True):
    """Every step's latents bit for bit those of the two single-process forwards (same kernels, same thread count;
    `exact` False: ranks that split the tokens attend in another order, within LATENT_BOUND), within LATENT_BOUND of
    the default batched forward, its images within 1 uint8 level; the ranks ran every tick. TaylorSeer
    extrapolates from its last two computed steps: a rounding difference (between one forward of 2B rows and two of
    B rows, or another token order) grows about tenfold over its steps (1.1e-4): its rows within 20 x LATENT_BOUND."""
    calls = parallel.workers.calls
    latents, images = step_latents(parallel, arrivals)
    ticks = parallel.workers.calls - calls
    exact_latents, _ = step_latents(two_forwards, arrivals)
    expected_latents, expected_images = step_latents(single, arrivals)
    for rid, (_, p) in arrivals.items():
        bound = 20 * LATENT_BOUND if p.cache == "taylorseer" else LATENT_BOUND
        if exact:
            assert np.array_equal(latents[rid], exact_latents[rid]), rid
        else:
            assert np.abs(latents[rid] - exact_latents[rid]).max() <= bound, rid
        assert np.abs(latents[rid] - expected_latents[rid]).max() <= bound, rid
        levels = np.abs(to_uint8(images[rid]).astype(int) - to_uint8(expected_images[rid]).astype(int))
        assert levels.max() <= 1, rid
    frees = sum(rank_states.caches(p) for _, p in arrivals.values())  # each request that cached: one free at its end
    assert ticks == max(at + p.num_inference_steps for at, p in arrivals.values()) + frees


def mixed_loras_and_caches(single) -> dict:
    """Two LoRAs and none, the first-block cache and TaylorSeer, joining at ticks 0, 1 and 2."""
    kinds = [dict(lora_name="toy_a", lora_scale=0.7, cache="first_block", cache_threshold=0.3, num_images=2),
             dict(lora_name="toy_b", cache="taylorseer"), dict(cache="first_block", cache_threshold=0.6)]
    return {f"r{i}": (i, parse(single, dict(prompt=prompt, num_inference_steps=6, seed=i, **CFG, **kind)))
            for i, (prompt, kind) in enumerate(zip(("a cat", "a red car on a long road", "fruit"), kinds))}


def assert_same_cached_run(parallel, single, two_forwards, arrivals, exact=True):
    """assert_same_run with step caches: the caches reused steps (so they were run), the driver counts the ranks'
    decisions as one process counts its own (the cache metrics), and the ranks hold no cache after the run."""
    ranks, one = Counter(parallel.cache_steps), Counter(two_forwards.cache_steps)
    assert_same_run(parallel, single, two_forwards, arrivals, exact=exact)
    one = two_forwards.cache_steps - one
    assert one["reused"] > 0 and parallel.cache_steps - ranks == one  # the driver counts the ranks' decisions
    assert parallel.workers.call_all("held_states", [()] * parallel.workers.world_size) == [0] * \
        parallel.workers.world_size
