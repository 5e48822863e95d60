"""The first-block cache (engine_lib/pipelines/step_cache.py) on the tiny Qwen-Image (CPU, float32).

A solo request with `cache=first_block` is bitwise what diffusers' own hook gives (`enable_cache(
FirstBlockCacheConfig(threshold))`, one cache state per CFG branch); in a shared step batch each request and
CFG branch decides alone, and the rows that reuse never enter the blocks after the first (counted by a hook
on the last block's text MLP, which sees every row the block runs). The state is the request's: it survives
a pause beside other cached requests, moves with the state and goes with it.
"""

from __future__ import annotations

from functools import partial

import pytest

from engine_lib.config import EngineConfig
from engine_lib.pipelines.qwen_image.adapter import QwenImageAdapter
from engine_lib.pipelines.step_cache import caches, threshold
from engine_lib.request import InvalidInputError
from tests.helpers.parity_checks import load_tiny_adapter, parse, solo_steps
from tests.helpers.step_cache_checks import (STEPS, cached_inputs, check_decisions_at_the_edge,
                                             check_pause_resume_and_abort, check_rows_decide_alone, check_shared_batch,
                                             check_solo_is_the_hooks, diffusers_cache, lora_runner, rows_into,
                                             with_options)

# Thresholds measured on the tiny model with these inputs (relative residual changes 0.2-0.45): 0.5 reuses 4 of
# the 6 steps, 0.3 some, 0.05 none; none sits near a decision's edge.
BASE = {"prompt": "a cat", "num_inference_steps": STEPS, "height": 64, "width": 64}
cached = partial(cached_inputs, BASE)  # cached(threshold, seed=3, **extra): BASE with the cache on


@pytest.fixture(scope="module")
def adapter() -> QwenImageAdapter:
    return load_tiny_adapter("qwen_image", QwenImageAdapter)


@pytest.fixture
def tail_rows(adapter):
    """Rows entering the last block, per call: its text MLP sees one row per row the block runs (packed image
    streams too), and is not called for a forward diffusers' hook skips."""
    yield from rows_into(adapter.pipe.transformer.transformer_blocks[-1].txt_mlp)


def test_inputs_are_declared_per_row_and_checked(adapter):
    p = parse(adapter, {"prompt": "x"})
    assert (p.cache, p.cache_threshold) == (None, None) and not caches(p) and threshold(p) == 0.05
    deployed = adapter.input_schema(EngineConfig.from_parameters(
        {"default_cache": "first_block", "default_cache_threshold": "0.2"})).parse({"prompt": "x"})
    assert caches(deployed) and threshold(deployed) == pytest.approx(0.2)
    assert adapter.step_key(parse(adapter, cached(0.5))) == adapter.step_key(parse(adapter, {**BASE, "seed": 3}))
    for name, value in (("cache", "fast"), ("cache_threshold", -1.0), ("cache_threshold", float("nan"))):
        with pytest.raises(InvalidInputError) as info:
            parse(adapter, {"prompt": "x", name: value})
        assert info.value.input_name == name


@pytest.mark.parametrize("cfg", [False, True], ids=["no_cfg", "true_cfg"])
def test_a_solo_request_is_bitwise_diffusers_first_block_cache(adapter, tail_rows, cfg):
    """Both paths decide alike and give the same image; with true CFG each branch has its own state
    (diffusers' cache contexts "cond" and "uncond": two forwards, so cfg_batching off)."""
    inputs = cached(0.5, **(dict(negative_prompt="bad quality", true_cfg_scale=4.0) if cfg else {}))
    check_solo_is_the_hooks(adapter, tail_rows, inputs, diffusers_cache, "qwen_image", cfg)


def test_rows_decide_alone_in_a_shared_batch_and_reusing_rows_skip_the_blocks(adapter, tail_rows):
    """Four requests (cache off, first_block at 0.3 and 0.5) joining at ticks 0-2 share every forward; each
    image is within one uint8 level of its solo run, and the last block sees exactly the rows whose own
    request computed there solo (the same decisions, made per row)."""
    requests = {"off": {**BASE, "seed": 1}, "a": cached(0.3, seed=2), "b": cached(0.5, seed=3),
                "c": cached(0.5, seed=4)}
    check_rows_decide_alone(adapter, tail_rows, requests, "qwen_image")


def test_a_paused_cached_request_resumes_as_if_never_paused_and_abort_frees_its_cache(adapter):
    """Paused after two steps while another cached request runs to its end, then resumed: the same image as
    its uninterrupted run. Its cache moves with its state (every tensor, and back), and freeing the state
    (an abort) releases the cached residuals."""
    check_pause_resume_and_abort(adapter, parse(adapter, cached(0.5, seed=5)), STEPS,
                                 parse(adapter, cached(0.5, seed=6, num_inference_steps=3)), 3, {"cond"})


def test_rows_of_different_sizes_decide_alone_in_a_packed_forward(adapter, tail_rows):
    """With mixed_size_batching, cached rows of two sizes and an uncached one share packed forwards: each image
    within one uint8 level of its solo run, and the last block sees only the rows that computed solo."""
    mixed = with_options(adapter, mixed_size_batching=True)
    requests = {"off": {**BASE, "seed": 1, "height": 32}, "a": cached(0.5, seed=2),
                "b": cached(0.3, seed=3, height=32, width=48)}
    solo_rows, _ = check_shared_batch(mixed, tail_rows, requests, ((0, "off"), (0, "a"), (1, "b")))
    print(f"packed: rows through the last block: {sum(tail_rows)} of {STEPS * len(requests)}; solo: {solo_rows}")
    assert sum(tail_rows) == sum(solo_rows.values()) < STEPS * len(requests)


@pytest.fixture(scope="module")
def lora_adapter(adapter) -> QwenImageAdapter:
    return lora_runner(adapter, "qwen_image")


@pytest.mark.parametrize("sizes", ["one_size", "mixed_sizes"])
def test_rows_that_compute_alone_keep_their_own_lora(lora_adapter, tail_rows, sizes):
    """The rows that run the later blocks on their own carry their own LoRA (toy_a, none, toy_b), one size or
    packed: each image within one uint8 level of its solo run."""
    requests = {"a": cached(0.5, seed=2, lora_name="toy_a"), "plain": cached(0.05, seed=3),
                "b": cached(0.3, seed=4, lora_name="toy_b", **({"height": 32} if sizes != "one_size" else {}))}
    check_shared_batch(lora_adapter, tail_rows, requests, ((0, "a"), (0, "plain"), (1, "b")))
    assert sum(tail_rows) < STEPS * len(requests)


def test_a_decision_at_the_thresholds_edge_is_diffusers(adapter, tail_rows):
    """Thresholds just under, at and just over the second step's measured change: it computes only under it, and
    each run decides as diffusers' hook does (3 steps)."""
    check_decisions_at_the_edge(adapter, tail_rows, {**BASE, "num_inference_steps": 3}, "qwen_image")


def test_the_metrics_count_decisions_not_rows(adapter, tail_rows):
    """num_images 2 with true CFG in one forward: 4 rows, 2 decisions (one per branch) per step. The adapter's
    counts (diffusion_cache_steps_total's source) add up to those decisions, and each computing one sends its 2
    rows through the last block."""
    inputs = cached(0.5, num_images=2, negative_prompt="bad quality", true_cfg_scale=4.0)
    before = adapter.counters()
    solo_steps(adapter, inputs)
    computed, reused = (adapter.counters()[k] - before[k] for k in ("cache_steps_computed", "cache_steps_reused"))
    print(f"qwen_image num_images 2, true CFG: {computed} decisions computed, {reused} reused")
    assert computed + reused == 2 * STEPS and reused >= 1
    assert sum(tail_rows) == 2 * computed
