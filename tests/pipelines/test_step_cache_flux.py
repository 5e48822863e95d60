"""The first-block cache on the tiny Flux (CPU, float32): engine_lib/pipelines/flux/first_block.py.

diffusers' hook takes Flux's first dual-stream block as its head and its last single-stream block as its tail, so
a step that reuses skips every single-stream block too. A solo request is bitwise what the hook gives; in a shared
step batch each request and CFG branch decides alone, and the rows that reuse never reach the single-stream
blocks (counted by a hook on the last one's modulation, which sees one row per row the block runs, packed image
streams too, and is not called for a forward the hook skips).
"""

from __future__ import annotations

import numpy as np
import pytest
from diffusers.hooks import FirstBlockCacheConfig

from engine_lib.pipelines.flux.adapter import FluxAdapter
from engine_lib.pipelines.step_cache import threshold
from parity_checks import (FLOAT_BOUND, Arrival, drive_steps, image_diff, load_tiny_adapter, parse, solo_steps,
                           with_cfg_batching)

STEPS = 6
# Measured on the tiny model with these inputs: the first block's residual changes by 0.36-0.49 relative to the
# first step's, so 0.5 reuses all 5 later steps, 0.4 some, 0.3 none.
BASE = {"prompt": "a cat", "num_inference_steps": STEPS, "height": 64, "width": 64, "max_sequence_length": 32}


@pytest.fixture(scope="module")
def adapter() -> FluxAdapter:
    return load_tiny_adapter("flux", FluxAdapter)


@pytest.fixture
def tail_rows(adapter):
    """Rows entering the last single-stream block, per call."""
    calls = []
    linear = adapter.pipe.transformer.single_transformer_blocks[-1].norm.linear
    handle = linear.register_forward_pre_hook(lambda m, args: calls.append(args[0].shape[0]))
    yield calls
    handle.remove()


def cached(threshold: float, seed: int = 3, **extra) -> dict:
    return {**BASE, "seed": seed, "cache": "first_block", "cache_threshold": threshold, **extra}


def test_the_cache_inputs_are_flux_inputs_per_row(adapter):
    names = [spec.name for spec in adapter.input_specs()]
    assert {"cache", "cache_threshold"} <= set(names)
    assert adapter.step_key(parse(adapter, cached(0.5))) == adapter.step_key(parse(adapter, {**BASE, "seed": 3}))


@pytest.mark.parametrize("cfg", [False, True], ids=["no_cfg", "true_cfg"])
def test_a_solo_request_is_bitwise_diffusers_first_block_cache(adapter, tail_rows, cfg):
    """Both paths decide alike and give the same image; with true CFG each branch has its own state (FluxPipeline's
    cache contexts "cond" and "uncond": two forwards, so cfg_batching off)."""
    inputs = cached(0.4, **(dict(negative_prompt="bad quality", true_cfg_scale=4.0) if cfg else {}))
    ours = solo_steps(with_cfg_batching(adapter, not cfg), inputs, float_output=True)
    ours_rows = list(tail_rows)
    tail_rows.clear()
    p = parse(adapter, inputs)
    adapter.pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold(p)))
    try:
        reference = adapter.pipe(**adapter.pipe_kwargs(p), output_type="np").images
    finally:
        adapter.pipe.transformer.disable_cache()
    branches = 2 if cfg else 1
    skipped = STEPS * branches - len(tail_rows)
    print(f"flux first_block 0.4, {STEPS} steps x {branches} branches: diffusers' hook reused {skipped}")
    assert skipped >= 1 and ours_rows == tail_rows
    assert np.array_equal(ours, reference)
    if cfg:  # cond and uncond as one forward of 2 rows (the default): the same decisions, each branch its own
        reference_rows = list(tail_rows)
        tail_rows.clear()
        assert image_diff(solo_steps(adapter, inputs, float_output=True), reference) <= FLOAT_BOUND
        assert sum(tail_rows) == len(reference_rows)


@pytest.mark.parametrize("sizes", ["one_size", "mixed_sizes"])
def test_rows_decide_alone_in_a_shared_batch_and_reusing_rows_skip_the_single_blocks(adapter, tail_rows, sizes):
    """Requests with the cache off and at thresholds 0.3, 0.4 and 0.5 join at ticks
    0-2 and share every forward, of one size or packed: each image is within one uint8 level of its solo run, and
    the last single-stream block sees exactly the rows whose own request and branch computed there solo."""
    mixed = sizes == "mixed_sizes"
    runner = type(adapter)(adapter.pipe, adapter.device, adapter.dtype, {**adapter.options, "mixed_size_batching": mixed})
    small = {"height": 32, "width": 48} if mixed else {}
    requests = {"off": {**BASE, "seed": 1, **small}, "a": cached(0.3, seed=2), "b": cached(0.5, seed=3, **small),
                "c": cached(0.4, seed=4)}
    solo_rows, solo = {}, {}
    for rid, inputs in requests.items():
        tail_rows.clear()
        solo[rid] = solo_steps(runner, inputs)
        solo_rows[rid] = sum(tail_rows)
    tail_rows.clear()
    before = runner.counters()
    ticks = ((0, "off"), (0, "a"), (1, "b"), (2, "c"))
    result = drive_steps(runner, [Arrival(t, rid, requests[rid]) for t, rid in ticks], capacity=4)
    assert max(result.forward_sizes) == 4 and result.forward_sizes == result.batch_sizes  # none retried alone
    for rid, image in result.images.items():
        assert np.abs(image.astype(int) - solo[rid].astype(int)).max() <= 1, rid
    print(f"flux {sizes}: rows through the last single block {sum(tail_rows)}; solo: {solo_rows}")
    assert solo_rows["off"] == STEPS and solo_rows["b"] < STEPS
    assert sum(tail_rows) == sum(solo_rows.values())
    # the metrics' counts: one decision per caching request and step (the request without the cache makes none)
    counts = {k: runner.counters()[k] - before[k] for k in ("cache_steps_computed", "cache_steps_reused")}
    computed = sum(solo_rows.values()) - solo_rows["off"]
    assert counts == {"cache_steps_computed": computed, "cache_steps_reused": 3 * STEPS - computed}


@pytest.fixture(scope="module")
def lora_adapter(adapter) -> FluxAdapter:
    """The same pipe with the toy LoRAs and mixed_size_batching (one LoRA library per pipe)."""
    from engine_lib.tiny_models import ensure_loras, ensure_model

    loras = ensure_loras("flux", ensure_model("flux", "tiny"))
    return type(adapter)(adapter.pipe, adapter.device, adapter.dtype,
                         {**adapter.options, "lora_dir": str(loras), "mixed_size_batching": True})


@pytest.mark.parametrize("sizes", ["one_size", "mixed_sizes"])
def test_rows_that_compute_alone_keep_their_own_lora(lora_adapter, tail_rows, sizes):
    """The rows that run the later blocks on their own carry their own LoRA (toy_a, none, toy_b), one size or
    packed: each image within one uint8 level of its solo run."""
    requests = {"a": cached(0.5, seed=2, lora_name="toy_a"), "plain": cached(0.05, seed=3),
                "b": cached(0.4, seed=4, lora_name="toy_b", **({"height": 32} if sizes != "one_size" else {}))}
    solo = {rid: solo_steps(lora_adapter, inputs) for rid, inputs in requests.items()}
    tail_rows.clear()
    result = drive_steps(lora_adapter, [Arrival(t, rid, requests[rid]) for t, rid in ((0, "a"), (0, "plain"),
                                                                                      (1, "b"))])
    assert max(result.forward_sizes) == 3 and result.forward_sizes == result.batch_sizes
    assert sum(tail_rows) < STEPS * len(requests)
    for rid, image in result.images.items():
        assert np.abs(image.astype(int) - solo[rid].astype(int)).max() <= 1, rid
