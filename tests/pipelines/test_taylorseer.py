"""TaylorSeer (engine_lib/pipelines/taylorseer.py) on the tiny Qwen-Image, Flux and SD3 (CPU, float32).

A solo request with `cache=taylorseer` is bitwise what diffusers' own hook gives (`enable_cache(
TaylorSeerCacheConfig())`; on SD3, which has no cache context, `apply_taylorseer_cache` under one), with its
defaults: over 6 steps, steps 3 and 5 predict. A hook on the last attention module's `to_q` counts the rows that
really run attention, so the tests count the work a prediction saves. In a shared step batch each request
decides from its own step; its factors are its own, survive a pause and go with it.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import numpy as np
import pytest
import torch
from diffusers.hooks import HookRegistry, TaylorSeerCacheConfig, apply_taylorseer_cache
from diffusers.hooks.hooks import CacheContext, _set_cache_context

from engine_lib.pipelines import taylorseer
from engine_lib.pipelines.base import move_tensors
from engine_lib.pipelines.flux.adapter import FluxAdapter
from engine_lib.pipelines.qwen_image.adapter import QwenImageAdapter
from engine_lib.pipelines.sd3.adapter import SD3Adapter
from engine_lib.request import DiffusionRequest
from engine_lib.runner import ModelRunner
from tests.helpers.parity_checks import (Arrival, load_tiny_adapter, parse, run_arrivals, run_steps, solo_steps,
                                         step_engine, with_cfg_batching)
from tests.helpers.step_cache_checks import STEPS, cached_inputs, lora_runner, rows_into, with_parameters

PREDICTED = [step for step in range(STEPS) if not taylorseer.computes(step)]  # [3, 5]
BASE = {"prompt": "a cat", "num_inference_steps": STEPS, "height": 64, "width": 64, "cache": "taylorseer"}
PIPELINES = {  # the adapter, and a request with CFG where the pipeline's CFG is cheap to run
    "qwen_image": (QwenImageAdapter, {"negative_prompt": "blurry"}),  # two cache contexts, "cond" and "uncond"
    "flux": (FluxAdapter, {"max_sequence_length": 32}),
    "sd3": (SD3Adapter, {"guidance_scale": 5.0}),  # one call of [uncond; cond]
}


@pytest.fixture(scope="module")
def qwen() -> QwenImageAdapter:
    return load_tiny_adapter("qwen_image", QwenImageAdapter)


counting = contextlib.contextmanager(rows_into)  # counting(module): the rows entering it, one entry per call


def attention_rows(adapter):
    """The rows that run the last attention module, per call."""
    return counting(taylorseer.attention_modules(adapter.pipe.transformer)[-1].to_q)


@contextlib.contextmanager
def diffusers_taylorseer(transformer):
    """diffusers' hook with its defaults: `enable_cache` where the transformer has cache contexts, else
    `apply_taylorseer_cache` under the one context SD3's pipeline would need."""
    if hasattr(transformer, "enable_cache"):
        transformer.enable_cache(TaylorSeerCacheConfig())
        try:
            yield
        finally:
            transformer.disable_cache()
        return
    apply_taylorseer_cache(transformer, TaylorSeerCacheConfig())
    _set_cache_context(transformer, CacheContext("cond"))
    try:
        yield
    finally:
        _set_cache_context(transformer, None)
        HookRegistry.check_if_exists_or_initialize(transformer).remove_hook("taylorseer_cache", recurse=True)


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_a_solo_request_is_bitwise_diffusers_hook(pipeline, qwen):
    """Our request alone (Qwen-Image: cond and uncond as two forwards, as its pipeline runs them) against
    `pipe(...)` under diffusers' hook: the same rows run attention on the same calls, and the same image."""
    cls, extra = PIPELINES[pipeline]
    adapter = qwen if pipeline == "qwen_image" else load_tiny_adapter(pipeline, cls)
    inputs = {**BASE, "seed": 3, **extra}
    with attention_rows(adapter) as rows:
        ours = solo_steps(with_cfg_batching(adapter, pipeline != "qwen_image"), inputs, float_output=True)
        ours_rows = list(rows)
        rows.clear()
        with diffusers_taylorseer(adapter.pipe.transformer):
            reference = adapter.pipe(**adapter.pipe_kwargs(parse(adapter, inputs)), output_type="np").images
    calls = STEPS * (2 if pipeline == "qwen_image" else 1)
    print(f"{pipeline}: attention ran on {len(rows)} of {calls} calls under diffusers' hook")
    assert len(rows) == calls - len(PREDICTED) * calls // STEPS and ours_rows == rows
    assert np.array_equal(ours, reference)


def test_a_shared_batch_decides_per_row(qwen):
    """The cache off, first_block at 0.3 and 0.5 and taylorseer join at ticks 0, 0, 1 and 2 and share every
    forward: each image within one uint8 level of its solo run; the last block runs exactly the rows whose own
    request computed it solo (first_block's reuses skip it) and its attention exactly the rows whose request
    ran attention solo (taylorseer's predictions skip it)."""
    base = {k: v for k, v in BASE.items() if k != "cache"}
    requests = {"off": {**base, "seed": 1}, "a": cached_inputs(base, 0.3, seed=2),
                "b": cached_inputs(base, 0.5, seed=3), "seer": {**BASE, "seed": 4}}
    tail = qwen.pipe.transformer.transformer_blocks[-1].txt_mlp
    solo, solo_rows = {}, {}
    for rid, inputs in requests.items():
        with attention_rows(qwen) as attn_rows, counting(tail) as tail_rows:
            solo[rid] = solo_steps(qwen, inputs)
        solo_rows[rid] = (sum(attn_rows), sum(tail_rows))
    before = qwen.counters()
    with attention_rows(qwen) as attn_rows, counting(tail) as tail_rows:
        result = run_steps(qwen, [Arrival(t, rid, requests[rid]) for t, rid in
                                    ((0, "off"), (0, "a"), (1, "b"), (2, "seer"))])
    print(f"qwen_image shared: rows through attention and the last block {sum(attn_rows)}, {sum(tail_rows)}; "
          f"solo {solo_rows}")
    assert max(result.forward_sizes) == 4 and result.forward_sizes == result.batch_sizes
    for rid, image in result.images.items():
        assert np.abs(image.astype(int) - solo[rid].astype(int)).max() <= 1, rid
    assert solo_rows["seer"] == (STEPS - len(PREDICTED), STEPS) and solo_rows["b"][1] < STEPS
    assert (sum(attn_rows), sum(tail_rows)) == tuple(map(sum, zip(*solo_rows.values())))
    reused = 2 * STEPS - solo_rows["a"][1] - solo_rows["b"][1] + len(PREDICTED)
    counts = {k: qwen.counters()[k] - before[k] for k in ("cache_steps_computed", "cache_steps_reused")}
    assert counts == {"cache_steps_computed": 3 * STEPS - reused, "cache_steps_reused": reused}


@pytest.mark.parametrize("packed", [False, True], ids=["step batch", "packed"])
def test_prompts_of_other_lengths_joining_and_leaving_keep_each_request_as_it_runs_solo(packed, qwen):
    """A request's text stream is padded to its batch's longest prompt, which changes as requests join and leave;
    its TaylorSeer factors keep its own tokens (`taylorseer.fit`). A TaylorSeer request joined by one with a longer
    prompt, or outliving it, at a step where it computes or predicts, stays within one level of its solo run, and
    so does the other (also of another size, packed)."""
    adapter = with_parameters(qwen, mixed_size_batching=True) if packed else qwen
    short = {**BASE, "seed": 1, "prompt": "a cat"}
    long = {**BASE, "seed": 2, "prompt": "a long prompt about a bowl of fruit on a wooden table in the morning light",
            **({"height": 96} if packed else {})}
    plain_long = {k: v for k, v in long.items() if k != "cache"}
    solo = {id(params): solo_steps(adapter, params) for params in (short, long, plain_long)}
    for first, second in ((short, long), (long, short), (short, plain_long)):
        for tick in (1, 2, 3, 4):  # the first request at its steps 1 to 4: computing (1, 2, 4) and predicting (3)
            images = run_steps(adapter, [Arrival(0, "a", first), Arrival(tick, "b", second)]).images
            for rid, params in (("a", first), ("b", second)):
                assert np.abs(images[rid].astype(int) - solo[id(params)].astype(int)).max() <= 1, (tick, rid)


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_packed_with_a_lora_row_the_rows_that_compute_alone_take_their_own_loras(pipeline, qwen):
    """Packed (mixed sizes), a TaylorSeer request without a LoRA and one with a LoRA of another size: at a step
    where one predicts, the other's attention runs alone, its text stream one row [1, L, ...], which the LoRA
    hooks took for the packed image stream (the batched forward failed and ran again one by one). Each forward
    stays shared and each image within one level of its solo run."""
    cls, _ = PIPELINES[pipeline]
    adapter = lora_runner(qwen if pipeline == "qwen_image" else load_tiny_adapter(pipeline, cls), pipeline)
    requests = {"plain": {**BASE, "seed": 1, "num_inference_steps": 8},
                "lora": {**BASE, "seed": 2, "height": 96, "width": 96, "lora_name": "toy_a", "lora_scale": 0.6}}
    result = run_steps(adapter, [Arrival(0, "lora", requests["lora"]), Arrival(2, "plain", requests["plain"])])
    assert 2 in result.forward_sizes and 1 not in result.forward_sizes[2:6], result.forward_sizes  # none retried
    for rid, params in requests.items():
        assert np.abs(result.images[rid].astype(int) - solo_steps(adapter, params).astype(int)).max() <= 1, rid


def test_a_batched_forward_that_fails_part_way_runs_again_with_the_factors_intact(qwen):
    """The runner runs a failed batched forward again one request at a time. The attention modules before the
    failure have renewed their factors at that step already, and renew them again (the outputs anew, the
    differences kept: no division by a zero step): each request still equals its solo run. The planted failure
    is in the last block, at the batched forwards of step 0 and of step 4, both computing steps."""
    requests = {"a": {**BASE, "seed": 1}, "b": {**BASE, "seed": 2, "prompt": "a dog on a sofa"}}
    solo = {rid: solo_steps(qwen, params) for rid, params in requests.items()}
    last = qwen.pipe.transformer.transformer_blocks[-1]
    forward, batched_calls, failed = last.forward, [], []

    def failing(*args, **kwargs):
        if (args[0] if args else kwargs["hidden_states"]).shape[0] > 1:
            batched_calls.append(1)
            if len(batched_calls) in (1, 5):  # the retried steps' calls are one row each
                failed.append(len(batched_calls))
                raise RuntimeError("a planted failure in the last block")
        return forward(*args, **kwargs)

    last.forward = failing
    try:
        result = run_steps(qwen, [Arrival(0, rid, params) for rid, params in requests.items()])
    finally:
        del last.forward
    assert failed == [1, 5]
    for rid, image in result.images.items():
        assert np.abs(image.astype(int) - solo[rid].astype(int)).max() <= 1, rid


def test_pause_and_resume_equal_the_uninterrupted_runs(qwen):
    """Two taylorseer requests share a batch until a more urgent one takes the seat of the least urgent,
    which resumes later (its factors kept): both end as they do alone."""
    engine = step_engine(qwen, capacity=2, max_preemptions=1)
    slow = Arrival(0, "slow", parse(qwen, {**BASE, "seed": 1}), priority=3)
    other = Arrival(1, "other", parse(qwen, {**BASE, "seed": 2}), priority=2)
    urgent = Arrival(3, "urgent", parse(qwen, {**BASE, "seed": 5, "num_inference_steps": 2}), priority=1)
    result = run_arrivals(engine, [slow, other, urgent])
    assert result.paused == ["slow"] and engine.runner.num_states == 0
    np.testing.assert_array_equal(result.images["slow"], solo_steps(qwen, slow.params))
    np.testing.assert_array_equal(result.images["other"], solo_steps(qwen, other.params))


def test_the_factors_move_with_the_state_and_an_abort_frees_them(qwen):
    runner = ModelRunner(qwen)
    runner.execute_step([DiffusionRequest("r", parse(qwen, {**BASE, "seed": 1}), num_steps=STEPS)], [])
    state = runner.states["r"]
    factors = state.step_cache["cond"]
    assert len(factors) == len(taylorseer.attention_modules(qwen.pipe.transformer)) and factors[0].last_step == 0
    move_tensors(state, torch.device("meta"))  # a pause on a GPU
    assert {f.device.type for m in factors for orders in m.factors for f in orders} == {"meta"}
    gone = weakref.ref(factors[0].factors[0][0])
    del state, factors
    runner.free(["r"])  # an abort
    gc.collect()
    assert gone() is None and runner.num_states == 0


