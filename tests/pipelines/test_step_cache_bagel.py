"""The first-block cache on the tiny BAGEL (our own model code, engine_lib/pipelines/bagel/model.py; CPU, float32).

BAGEL has no diffusers hook, so the reference is `BagelPipeline`'s own loop for one request with diffusers'
FirstBlockCache math around its first decoder layer: each CFG branch its own forward and cache context, the
relative change of the first layer's residual (over the row's latent tokens) against the last computed step's,
and at or below the threshold the last tail residual added to the first layer's output. A hook on the last
layer's generation MLP counts the latent tokens that reach it, so a reusing row is seen to skip it.
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from unittest import mock

import numpy as np
import pytest
import torch

from engine_lib.pipelines.bagel.adapter import BagelAdapter
from engine_lib.pipelines.bagel.model import QueryRows
from engine_lib.pipelines.bagel.pipeline import GEN_THINK_SYSTEM_PROMPT, Guidance, guide
from engine_lib.pipelines.step_cache import threshold
from engine_lib.request import InvalidInputError
from tests.helpers.parity_checks import load_tiny_adapter, parse, step_latents
from tests.helpers.step_cache_checks import (STEPS, cached_inputs, check_pause_resume_and_abort, check_shared_batch,
                                             first_layer_cache, rows_into)

# The tiny model's first-layer residual changes little between steps: without CFG 0.05 reuses 3 of the 6 steps,
# 0.1 four; with CFG (the default interval) 0.05 reuses 6 of 11 branch forwards.
BASE = {"prompt": "a red cube on a blue floor", "num_inference_steps": STEPS, "height": 64, "width": 64}
cached = partial(cached_inputs, BASE)
TOKENS = 16  # latent tokens of a 64x64 image


@pytest.fixture(scope="module")
def adapter() -> BagelAdapter:
    return load_tiny_adapter("bagel", BagelAdapter)


@pytest.fixture
def tail_tokens(adapter):
    """Latent tokens entering the last layer's generation MLP, per call."""
    yield from rows_into(adapter.pipe.model.layers[-1].gen.mlp)


def reference(adapter: BagelAdapter, inputs: dict) -> tuple[torch.Tensor, Counter]:
    """`BagelPipeline.__call__`'s loop for one request, each branch its own forward, under diffusers'
    FirstBlockCache math per branch: its final latents and its decisions. With `think` the thought comes first,
    as `__call__` decodes and adds it; its image-CFG branch (`cfg_img_scale` > 1) is the prompt without it."""
    p, pipe, model = parse(adapter, inputs), adapter.pipe, adapter.pipe.model
    g = Guidance(p.guidance_scale, p.cfg_img_scale, tuple(p.cfg_interval), p.cfg_renorm_type, p.cfg_renorm_min)
    context = pipe.encode(p.prompt, p.height, p.width, GEN_THINK_SYSTEM_PROMPT if p.think else "")
    if p.think:
        thought = pipe.generate_text(context.cond, p.max_new_tokens, p.temperature, p.seed)
        pipe.add_thought(context, pipe.text(thought.ids), p.cfg_img_scale)
    x = pipe.initial_noise(p.seed, context)
    timesteps, dts = pipe.schedule(p.num_inference_steps, p.timestep_shift)
    run_layers, decisions, branches = model.run_layers, Counter(), {"cond": {}, "uncond": {}, "img": {}}

    def first_block_cache(state: dict):  # a row's latent tokens follow its <|vision_start|>
        return first_layer_cache(run_layers, len(model.layers), threshold(p), decisions, state,
                                 lambda n: slice(1, 1 + n))

    for t, dt in zip(timesteps, dts):
        contexts = [("cond", context.cond)]
        if g.active(float(t)):
            contexts += [("uncond", context.uncond)] + ([("img", context.img)] if context.img is not None else [])
        v = {}
        for branch, kv in contexts:
            rows = QueryRows.build([kv], [kv.length], [context.grid], model.config.max_latent_size,
                                   (pipe.start_of_image, pipe.end_of_image), pipe.device)
            with mock.patch.object(model, "run_layers", first_block_cache(branches[branch])):
                v[branch] = model.velocity(rows, x[None], t[None])[0]
        x = x - (guide(v["cond"], v["uncond"], g, v.get("img")) if "uncond" in v else v["cond"]) * dt
    return x, decisions


def test_the_inputs_are_declared_with_first_block_only(adapter):
    p = parse(adapter, cached(0.1))
    assert (p.cache, p.cache_threshold) == ("first_block", pytest.approx(0.1))
    assert adapter.step_key(p) == adapter.step_key(parse(adapter, {**BASE, "seed": 3}))
    for name, value in (("cache", "taylorseer"), ("cache", "fast"), ("cache_threshold", 2.0)):
        with pytest.raises(InvalidInputError) as info:
            parse(adapter, {"prompt": "x", name: value})
        assert info.value.input_name == name


@pytest.mark.parametrize("guidance, think", [(1.0, {}), (4.0, {}),
                                             (4.0, dict(think=True, max_new_tokens=8, cfg_img_scale=1.5))],
                         ids=["no_cfg", "cfg", "think_img_cfg"])
def test_a_solo_request_is_the_reference_loop_under_first_block_cache(adapter, tail_tokens, guidance, think):
    """The same decisions as the reference, the rows that reuse skip the last layer, and the same latents:
    bitwise without CFG; with CFG our one forward of two rows (three after a thought with image CFG) against the
    reference's forwards of one, within the float bound of BAGEL's batched runs (1e-5)."""
    inputs = cached(0.05, guidance_scale=guidance, **think)
    before = Counter(adapter.cache_steps)
    latents, _ = step_latents(adapter, {"r": (0, parse(adapter, inputs))})
    decisions = Counter(adapter.cache_steps) - before
    tokens = sum(tail_tokens)
    expected, reference_decisions = reference(adapter, inputs)
    print(f"bagel first_block 0.05, guidance {guidance:g}{' after a thought' if think else ''}: {dict(decisions)}")
    assert decisions == reference_decisions and decisions["reused"] >= 1
    assert tokens == decisions["computed"] * TOKENS  # a reusing row never reaches the last layer
    if guidance == 1.0:
        assert torch.equal(torch.from_numpy(latents["r"][-1]), expected)
    else:
        assert np.abs(latents["r"][-1] - expected.numpy()).max() <= 1e-5


def test_rows_decide_alone_in_a_shared_batch(adapter, tail_tokens):
    """The cache off, at 0.05 and at 0.1, with and without CFG, joining at ticks 0-2: every forward holds them all,
    each image within one uint8 level of its solo run, and the last layer sees exactly the latent tokens of the
    rows that computed there solo."""
    requests = {"off": {**BASE, "seed": 1}, "a": cached(0.05, seed=2), "b": cached(0.1, seed=3, guidance_scale=1.0)}
    solo_tokens, counts = check_shared_batch(adapter, tail_tokens, requests, ((0, "off"), (1, "a"), (2, "b")))
    print(f"bagel: tokens through the last layer {sum(tail_tokens)}; solo: {solo_tokens}; decisions {counts}")
    assert sum(tail_tokens) == sum(solo_tokens.values()) and counts["cache_steps_reused"] >= 2
    # the metrics' decisions: every computed one, and no reused one, reached the last layer
    assert sum(tail_tokens) == solo_tokens["off"] + counts["cache_steps_computed"] * TOKENS


def test_a_paused_cached_request_resumes_as_if_never_paused_and_abort_frees_its_cache(adapter):
    check_pause_resume_and_abort(adapter, parse(adapter, cached(0.05, seed=5)), STEPS,
                                 parse(adapter, cached(0.1, seed=6, num_inference_steps=3)), 3, {"cond", "uncond"})