"""The first-block cache on the tiny Flux (CPU, float32): engine_lib/pipelines/flux/first_block.py.

diffusers' hook takes Flux's first dual-stream block as its head and its last single-stream block as its tail, so
a step that reuses skips every single-stream block too. A solo request is bitwise what the hook gives; in a shared
step batch each request and CFG branch decides alone, and the rows that reuse never reach the single-stream
blocks (counted by a hook on the last one's modulation, which sees one row per row the block runs, packed image
streams too, and is not called for a forward the hook skips).
"""

from __future__ import annotations

from functools import partial

import pytest

from engine_lib.pipelines.flux.adapter import FluxAdapter
from tests.helpers.parity_checks import load_tiny_adapter, parse
from tests.helpers.step_cache_checks import (STEPS, cached_inputs, check_decisions_at_the_edge, check_rows_decide_alone,
                                             check_shared_batch, check_solo_is_the_hooks, diffusers_cache, lora_runner,
                                             rows_into, with_options)

# Measured on the tiny model with these inputs: the first block's residual changes by 0.36-0.49 relative to the
# first step's, so 0.5 reuses all 5 later steps, 0.4 some, 0.3 none.
BASE = {"prompt": "a cat", "num_inference_steps": STEPS, "height": 64, "width": 64, "max_sequence_length": 32}
cached = partial(cached_inputs, BASE)  # cached(threshold, seed=3, **extra): BASE with the cache on


@pytest.fixture(scope="module")
def adapter() -> FluxAdapter:
    return load_tiny_adapter("flux", FluxAdapter)


@pytest.fixture
def tail_rows(adapter):
    """Rows entering the last single-stream block, per call."""
    yield from rows_into(adapter.pipe.transformer.single_transformer_blocks[-1].norm.linear)


def test_the_cache_inputs_are_flux_inputs_per_row(adapter):
    names = [spec.name for spec in adapter.input_specs()]
    assert {"cache", "cache_threshold"} <= set(names)
    assert adapter.step_key(parse(adapter, cached(0.5))) == adapter.step_key(parse(adapter, {**BASE, "seed": 3}))


@pytest.mark.parametrize("cfg", [False, True], ids=["no_cfg", "true_cfg"])
def test_a_solo_request_is_bitwise_diffusers_first_block_cache(adapter, tail_rows, cfg):
    """Both paths decide alike and give the same image; with true CFG each branch has its own state (FluxPipeline's
    cache contexts "cond" and "uncond")."""
    inputs = cached(0.4, **(dict(negative_prompt="bad quality", true_cfg_scale=4.0) if cfg else {}))
    check_solo_is_the_hooks(adapter, tail_rows, inputs, diffusers_cache, "flux", cfg)


@pytest.mark.parametrize("sizes", ["one_size", "mixed_sizes"])
def test_rows_decide_alone_in_a_shared_batch_and_reusing_rows_skip_the_single_blocks(adapter, tail_rows, sizes):
    """Requests with the cache off and at thresholds 0.3, 0.4 and 0.5 join at ticks
    0-2 and share every forward, of one size or packed: each image is within one uint8 level of its solo run, and
    the last single-stream block sees exactly the rows whose own request and branch computed there solo."""
    mixed = sizes == "mixed_sizes"
    runner = with_options(adapter, mixed_size_batching=mixed)
    small = {"height": 32, "width": 48} if mixed else {}
    requests = {"off": {**BASE, "seed": 1, **small}, "a": cached(0.3, seed=2), "b": cached(0.5, seed=3, **small),
                "c": cached(0.4, seed=4)}
    check_rows_decide_alone(runner, tail_rows, requests, f"flux {sizes}")


@pytest.fixture(scope="module")
def lora_adapter(adapter) -> FluxAdapter:
    return lora_runner(adapter, "flux")


@pytest.mark.parametrize("sizes", ["one_size", "mixed_sizes"])
def test_rows_that_compute_alone_keep_their_own_lora(lora_adapter, tail_rows, sizes):
    """The rows that run the later blocks on their own carry their own LoRA (toy_a, none, toy_b), one size or
    packed: each image within one uint8 level of its solo run."""
    requests = {"a": cached(0.5, seed=2, lora_name="toy_a"), "plain": cached(0.05, seed=3),
                "b": cached(0.4, seed=4, lora_name="toy_b", **({"height": 32} if sizes != "one_size" else {}))}
    check_shared_batch(lora_adapter, tail_rows, requests, ((0, "a"), (0, "plain"), (1, "b")))
    assert sum(tail_rows) < STEPS * len(requests)


def test_a_decision_at_the_thresholds_edge_is_diffusers(adapter, tail_rows):
    """Thresholds just under, at and just over the second step's measured change: it computes only under it, and
    each run decides as diffusers' hook does (3 steps)."""
    check_decisions_at_the_edge(adapter, tail_rows, {**BASE, "num_inference_steps": 3}, "flux")
