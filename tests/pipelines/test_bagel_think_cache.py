"""BAGEL's think mode with what it combines with: the thought's KV cache released after its text phase (counted in
bytes held), and the first-block cache over a thought's three rows (text CFG, and image CFG against the context
without the thought), solo and in a step batch of three joining at different ticks (tiny model, CPU, float32)."""

from __future__ import annotations

import numpy as np
import pytest

from engine_lib.interface import to_uint8
from engine_lib.pipelines.bagel.adapter import BagelAdapter
from engine_lib.pipelines.decoder_parts import held_bytes
from tests.helpers.parity_checks import load_tiny_adapter, run_ticks

LATENT_BOUND = 1e-5
STEPS = 6
# cfg_img_scale 1.5 after a thought: a third row per step inside the interval; the tiny model's first-layer residual
# changes little between steps, so 0.05 reuses some of each branch's steps.
THINK = dict(prompt="a red cube on a blue floor", think=True, max_new_tokens=8, num_inference_steps=STEPS,
             height=64, width=64, seed=3, guidance_scale=4.0, cfg_img_scale=1.5, cfg_interval=(0.3, 1.0))
CACHED = dict(THINK, cache="first_block", cache_threshold=0.05)
RUNS = {  # request id -> (tick it joins at, its inputs)
    "solo": {"cached": (0, CACHED)},
    # the cached thought, a sampled uncached thought of another size, a cached image without a thought
    "batch": {"cached": (0, CACHED),
              "sampled": (1, dict(THINK, prompt="fruit", seed=4, temperature=0.7, height=48, width=80)),
              "image": (3, dict(CACHED, think=False, prompt="a green sphere", seed=5, cache_threshold=0.1))},
}


@pytest.fixture(scope="module")
def adapter() -> BagelAdapter:
    return load_tiny_adapter("bagel", BagelAdapter)


def observe(runner) -> dict:
    """Each state's phase, the bytes its text holds, its latents (a copy) and its cache branches."""
    return {rid: (s.decoding, held_bytes(s.text), None if s.latents is None else s.latents.clone(),
                  sorted(s.step_cache)) for rid, s in runner.states.items()}


@pytest.fixture(scope="module")
def runs(adapter) -> dict:
    """Each of RUNS, with the decisions it counted."""
    out = {}
    for name, run in RUNS.items():
        before = adapter.counters()
        outputs, chunks, ticks = run_ticks(adapter, run, observe)
        decisions = {k: adapter.counters()[k] - before[k] for k in ("cache_steps_computed", "cache_steps_reused")}
        out[name] = outputs, chunks, ticks, decisions
    return out


def latents_of(ticks: list, rid: str) -> np.ndarray:
    """A request's latents from its initial noise on, after each denoise step but its last (the final image
    stands for that one)."""
    return np.stack([seen[rid][2].numpy() for seen in ticks if rid in seen and not seen[rid][0]
                     and seen[rid][2] is not None])


def test_the_thoughts_kv_cache_is_released_once_its_text_phase_ends(runs):
    """While the thought decodes its text holds its growing KV cache; from the first denoise step on it holds no
    byte (the image's context holds the thought re-encoded), for a cached and an uncached thought alike."""
    _, _, ticks, _ = runs["batch"]
    for rid in ("cached", "sampled"):
        phases = [(seen[rid][0], seen[rid][1]) for seen in ticks if rid in seen]
        decoding = [n for is_decoding, n in phases if is_decoding]
        assert len(decoding) == THINK["max_new_tokens"] - 1 and min(decoding) > 0
        assert decoding == sorted(decoding)  # one token's keys and values more per tick
        assert [n for is_decoding, n in phases if not is_decoding] == [0] * STEPS, rid  # (a finished state leaves the runner in its tick)


def test_the_first_block_cache_of_a_thought_with_image_cfg_equals_its_solo_run_in_a_batch(runs):
    """The cached thought decides per branch (cond, text uncond, image uncond: three rows), reuses some steps, and
    gives the same text, every step's latents within 1e-5 and the image within 1 level of its solo run while it
    shares forwards with a sampled uncached thought and a cached image of another threshold."""
    solo_outputs, solo_chunks, solo_ticks, solo_decisions = runs["solo"]
    outputs, chunks, ticks, decisions = runs["batch"]
    assert solo_decisions["cache_steps_reused"] >= 1
    assert [seen["cached"][3] for seen in ticks if "cached" in seen][-1] == ["cond", "img", "uncond"]
    assert outputs["cached"]["text"][0] == solo_outputs["cached"]["text"][0]
    assert chunks["cached"] == solo_chunks["cached"]
    expected, actual = latents_of(solo_ticks, "cached"), latents_of(ticks, "cached")
    assert actual.shape == expected.shape == (STEPS, *actual.shape[1:])
    assert np.abs(actual - expected).max() <= LATENT_BOUND
    levels = (to_uint8(outputs["cached"]["image"][0]).astype(int)
              - to_uint8(solo_outputs["cached"]["image"][0]).astype(int))
    assert np.abs(levels).max() <= 1
    assert outputs["sampled"]["text"][0] != outputs["cached"]["text"][0]
    assert decisions["cache_steps_reused"] > solo_decisions["cache_steps_reused"]


def test_a_thought_at_threshold_zero_equals_the_uncached_thought(adapter):
    """At threshold 0 every step computes: the three rows run the cached path and give the uncached latents."""
    before = adapter.counters()["cache_steps_reused"]
    _, _, cached = run_ticks(adapter, {"r": (0, dict(CACHED, cache_threshold=0.0))}, observe)
    assert adapter.counters()["cache_steps_reused"] == before
    _, _, plain = run_ticks(adapter, {"r": (0, THINK)}, observe)
    assert np.abs(latents_of(cached, "r") - latents_of(plain, "r")).max() <= LATENT_BOUND
