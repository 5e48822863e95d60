"""The first-block cache on the tiny HunyuanImage-3.0 (our own model code; CPU, float32).

As for BAGEL (test_step_cache_bagel.py): the reference is `HunyuanImage3Pipeline.__call__`'s loop for one request
with diffusers' FirstBlockCache math around its first decoder layer, each CFG branch its own forward and cache
context, the residual taken over the row's image tokens. A wrapper around `run_layers` counts the rows that
reach the last layer (its MoE also runs every prompt's prefill, so a module hook would count those too).
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from unittest import mock

import pytest
import torch

from engine_lib.pipelines.hunyuan_image3.adapter import HunyuanImage3Adapter
from engine_lib.pipelines.step_cache import threshold
from tests.helpers.parity_checks import load_tiny_adapter, parse, step_latents
from tests.helpers.step_cache_checks import (STEPS, cached_inputs, check_pause_resume_and_abort, check_shared_batch,
                                             first_layer_cache)

# The tiny model's first-layer residual changes by 0.1-0.2 from step to step (seed 3 solo: 0.1 reuses none of the
# 6 steps, 0.15 three, 0.2 five).
BASE = {"prompt": "a red cube on a blue floor", "num_inference_steps": STEPS, "height": 64, "width": 64,
        "flow_shift": 3.0}
cached = partial(cached_inputs, BASE)


@pytest.fixture(scope="module")
def adapter() -> HunyuanImage3Adapter:
    return load_tiny_adapter("hunyuan_image3", HunyuanImage3Adapter)


@pytest.fixture
def tail_rows(adapter):
    """Rows entering the last decoder layer, per forward that runs it."""
    model, seen = adapter.pipe.model, []
    run_layers, last = model.run_layers, model.config.num_layers - 1

    def counted(hidden, rows, layers):
        if last in layers:
            seen.append(hidden.shape[0])
        return run_layers(hidden, rows, layers)

    with mock.patch.object(model, "run_layers", counted):
        yield seen


def reference(adapter: HunyuanImage3Adapter, inputs: dict) -> tuple[torch.Tensor, Counter]:
    """`HunyuanImage3Pipeline.__call__`'s loop for one request, each branch its own forward, under diffusers'
    FirstBlockCache math per branch: its final latents and its decisions."""
    p, pipe, model = parse(adapter, inputs), adapter.pipe, adapter.pipe.model
    scale = float(p.guidance_scale)
    context = pipe.encode(p.prompt, p.height, p.width, cfg=scale > 1.0)
    x = pipe.initial_noise(p.seed, context)
    sigmas = pipe.sigmas(p.num_inference_steps, p.flow_shift)
    run_layers, decisions, branches = model.run_layers, Counter(), {"cond": {}, "uncond": {}}

    def first_block_cache(state: dict):  # a row's image tokens follow its <timestep>
        return first_layer_cache(run_layers, model.config.num_layers, threshold(p), decisions, state,
                                 lambda n: (0, slice(1, 1 + n)))

    for i in range(p.num_inference_steps):
        t = (torch.stack([sigmas[i]]).to(pipe.device) * 1000).float()
        pred = {}
        for branch, kv in (("cond", context.cond), ("uncond", context.uncond)):
            if kv is not None:
                with mock.patch.object(model, "run_layers", first_block_cache(branches[branch])):
                    [pred[branch]] = model.predict(model.image_rows([kv], [context.grid]), [x], t)
        guided = pred["uncond"] + scale * (pred["cond"] - pred["uncond"]) if "uncond" in pred else pred["cond"]
        x = x + guided * (sigmas[i + 1] - sigmas[i])
    return x, decisions


@pytest.mark.parametrize("guidance", [1.0, 5.0], ids=["no_cfg", "cfg"])
def test_a_solo_request_is_the_reference_loop_under_first_block_cache(adapter, tail_rows, guidance):
    """The same decisions as the reference, a reusing row never reaches the last layer, and the same latents:
    bitwise without CFG; with CFG our one forward of two rows against the reference's two forwards of one,
    within the float bound of Hunyuan's batched runs (1e-5)."""
    inputs = cached(0.15, guidance_scale=guidance)
    before = Counter(adapter.cache_steps)
    latents, _ = step_latents(adapter, {"r": (0, parse(adapter, inputs))})
    decisions = Counter(adapter.cache_steps) - before
    rows = sum(tail_rows)
    expected, reference_decisions = reference(adapter, inputs)
    print(f"hunyuan_image3 first_block 0.15, guidance {guidance:g}: {dict(decisions)}")
    assert decisions == reference_decisions and decisions["reused"] >= 1
    assert rows == decisions["computed"]
    shape = expected.shape
    ours = torch.from_numpy(latents["r"][-1]).reshape(shape)
    if guidance == 1.0:
        assert torch.equal(ours, expected)
    else:
        assert (ours - expected).abs().max() <= 1e-5


def test_rows_decide_alone_in_a_shared_batch(adapter, tail_rows):
    """The cache off, at 0.15 (CFG) and at 0.2 (no CFG; another size), joining at ticks 0-2: every forward holds
    them all, each image within one uint8 level of its solo run, and the last layer sees exactly the rows
    whose own request and branch computed there solo."""
    requests = {"off": {**BASE, "seed": 1, "guidance_scale": 1.0}, "a": cached(0.15, seed=2, guidance_scale=5.0),
                "b": cached(0.2, seed=3, guidance_scale=1.0, height=48, width=80)}
    solo_rows, counts = check_shared_batch(adapter, tail_rows, requests, ((0, "off"), (1, "a"), (2, "b")))
    print(f"hunyuan_image3: rows through the last layer {sum(tail_rows)}; solo: {solo_rows}; decisions {counts}")
    assert sum(tail_rows) == sum(solo_rows.values()) and counts["cache_steps_reused"] >= 2
    assert sum(tail_rows) == solo_rows["off"] + counts["cache_steps_computed"]  # the metrics' decisions


def test_a_paused_cached_request_resumes_as_if_never_paused_and_abort_frees_its_cache(adapter):
    inputs = parse(adapter, cached(0.15, seed=5, guidance_scale=5.0, num_inference_steps=4))
    other = parse(adapter, cached(0.2, seed=6, num_inference_steps=3, guidance_scale=1.0))
    check_pause_resume_and_abort(adapter, inputs, 4, other, 3, {"cond", "uncond"})