"""The first-block cache on the tiny SD3 (CPU, float32): engine_lib/pipelines/sd3/first_block.py.

diffusers' hook does not run on SD3 as shipped (no cache context; its tail hook subtracts from the text output
the last, `context_pre_only`, block does not return). The reference here is the hook with those two supplied: a
context, and the last block's text passed through from its input (the forward drops it). A solo request is
bitwise that; in a shared step batch each request decides alone and the rows that reuse never reach the last
block (counted by a hook on its modulation, which sees one row per row the block runs, packed streams too).
"""

from __future__ import annotations

import contextlib
from functools import partial

import pytest
from diffusers.hooks import FirstBlockCacheConfig, HookRegistry, apply_first_block_cache
from diffusers.hooks.hooks import CacheContext, _set_cache_context

from engine_lib.pipelines.sd3.adapter import SD3Adapter
from tests.helpers.parity_checks import FLOAT_BOUND, image_diff, load_tiny_adapter, solo_steps, with_cfg_batching
from tests.helpers.step_cache_checks import (STEPS, cached_inputs, check_rows_decide_alone, check_shared_batch,
                                             check_solo_is_the_hooks, lora_runner, rows_into, with_options)

# Measured on the tiny model with these inputs: the first block's residual changes by 0.30-0.53 relative to the
# first step's, so 0.6 reuses all 5 later steps, 0.4 some, 0.2 none. guidance_scale 1: no CFG.
BASE = {"prompt": "a cat", "num_inference_steps": STEPS, "height": 64, "width": 64, "guidance_scale": 1.0}
cached = partial(cached_inputs, BASE)  # cached(threshold, seed=3, **extra): BASE with the cache on


@pytest.fixture(scope="module")
def adapter() -> SD3Adapter:
    return load_tiny_adapter("sd3", SD3Adapter)


@pytest.fixture
def tail_rows(adapter):
    yield from rows_into(adapter.pipe.transformer.transformer_blocks[-1].norm1.linear)


@contextlib.contextmanager
def diffusers_first_block_cache(transformer, threshold: float):
    """`apply_first_block_cache` on SD3's transformer, with a cache context and the last block's text output."""
    tail = transformer.transformer_blocks[-1]
    forward = tail.forward
    tail.forward = lambda **kw: (kw["encoder_hidden_states"], forward(**kw)[1])
    apply_first_block_cache(transformer, FirstBlockCacheConfig(threshold=threshold))
    _set_cache_context(transformer, CacheContext("cond"))
    try:
        yield
    finally:
        _set_cache_context(transformer, None)
        registry = HookRegistry.check_if_exists_or_initialize(transformer)
        for name in ("fbc_leader_block_hook", "fbc_block_hook"):
            registry.remove_hook(name, recurse=True)
        del tail.forward


def test_a_solo_request_is_bitwise_the_hooks_math(adapter, tail_rows):
    check_solo_is_the_hooks(adapter, tail_rows, cached(0.4), diffusers_first_block_cache, "sd3")


def test_with_cfg_each_branch_decides_alone_in_one_forward_or_two(adapter, tail_rows):
    """SD3 runs CFG as one forward of [uncond; cond] rows (cfg_batching, the default) whose branches decide
    alone, as they do in two forwards: the same decisions and images within the float bound."""
    inputs = cached(0.4, guidance_scale=5.0)
    one = solo_steps(adapter, inputs, float_output=True)
    one_rows = sum(tail_rows)
    tail_rows.clear()
    two = solo_steps(with_cfg_batching(adapter, False), inputs, float_output=True)
    assert one_rows == len(tail_rows) < 2 * STEPS
    assert image_diff(one, two) <= FLOAT_BOUND


@pytest.mark.parametrize("sizes", ["one_size", "mixed_sizes"])
def test_rows_decide_alone_in_a_shared_batch_and_reusing_rows_skip_the_blocks(adapter, tail_rows, sizes):
    """Requests with the cache off and at thresholds 0.2, 0.4 and 0.6 join at ticks 0-2 and share every forward,
    of one size or packed: each image within one uint8 level of its solo run, and the last block sees exactly the
    rows whose own request computed there solo."""
    mixed = sizes == "mixed_sizes"
    runner = with_options(adapter, mixed_size_batching=mixed)
    small = {"height": 32, "width": 48} if mixed else {}
    requests = {"off": {**BASE, "seed": 1, **small}, "a": cached(0.2, seed=2), "b": cached(0.6, seed=3, **small),
                "c": cached(0.4, seed=4)}
    check_rows_decide_alone(runner, tail_rows, requests, f"sd3 {sizes}")


def test_rows_that_compute_alone_keep_their_own_lora(adapter, tail_rows):
    """In a packed forward, the rows that run the later blocks on their own carry their own LoRA (toy_a, none,
    toy_b): each image within one uint8 level of its solo run."""
    requests = {"a": cached(0.6, seed=2, lora_name="toy_a"), "plain": cached(0.2, seed=3),
                "b": cached(0.4, seed=4, lora_name="toy_b", height=32)}
    check_shared_batch(lora_runner(adapter, "sd3"), tail_rows, requests, ((0, "a"), (0, "plain"), (1, "b")))
    assert sum(tail_rows) < STEPS * len(requests)
