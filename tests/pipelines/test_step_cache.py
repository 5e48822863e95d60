"""The first-block cache (engine_lib/pipelines/step_cache.py) on the tiny Qwen-Image, Flux and SD3 (CPU, float32).

Each pipeline is one `Case`: its adapter, its inputs, thresholds measured on its tiny model, and the module of
its cache's tail block that counts rows. A solo request with `cache=first_block` is bitwise what diffusers' own
hook gives (`enable_cache(FirstBlockCacheConfig(threshold))`, one cache state per CFG branch; on SD3 the hook
with a context and the last block's text supplied, see `sd3_first_block_cache`); in a shared step batch, one size
or packed, each request and CFG branch decides alone, and the rows that reuse never reach the tail block. On
Qwen-Image the state is shown to be the request's: it survives a pause beside other cached requests, moves
with the state and goes with it.

Tail blocks: Qwen-Image's last block (its text MLP sees one row per row the block runs); Flux's last
single-stream block (diffusers' hook takes the first dual-stream block as head and the last single-stream one
as tail, so a step that reuses skips every single-stream block too; its modulation sees one row per row);
SD3's last block (its modulation).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import pytest
from diffusers.hooks import FirstBlockCacheConfig, HookRegistry, apply_first_block_cache
from diffusers.hooks.hooks import CacheContext, _set_cache_context

from engine_lib.config import EngineConfig
from engine_lib.pipelines.flux.adapter import FluxAdapter
from engine_lib.pipelines.qwen_image.adapter import QwenImageAdapter
from engine_lib.pipelines.sd3.adapter import SD3Adapter
from engine_lib.pipelines.step_cache import caches, threshold
from engine_lib.request import InvalidInputError
from tests.helpers.parity_checks import (FLOAT_BOUND, image_diff, load_tiny_adapter, parse, solo_steps,
                                         with_cfg_batching)
from tests.helpers.step_cache_checks import (STEPS, cached_inputs, check_decisions_at_the_edge,
                                             check_pause_resume_and_abort, check_rows_decide_alone, check_shared_batch,
                                             check_solo_is_the_hooks, diffusers_cache, lora_runner, rows_into,
                                             with_parameters)


@contextlib.contextmanager
def sd3_first_block_cache(transformer, threshold: float):
    """`apply_first_block_cache` on SD3's transformer, with a cache context and the last block's text output.

    diffusers' hook does not run on SD3 as shipped (no cache context; its tail hook subtracts from the text
    output the last, `context_pre_only`, block does not return): here the last block passes its text through
    from its input (the forward drops it)."""
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


@dataclass(frozen=True)
class Case:
    """One pipeline's tiny model under the cache, with thresholds measured on it for `base`."""

    adapter_class: type
    base: dict
    tail: Callable  # transformer -> the module whose calls count the rows through the tail block
    hook: Callable  # (transformer, threshold) -> diffusers' cache, as a context manager
    solo: float  # a solo request's threshold (some steps reused)
    shared: tuple[float, float, float]  # requests "a", "b" (which reuses solo) and "c" beside one uncached
    lora: tuple[float, float, float]  # requests "a" (toy_a), "plain" and "b" (toy_b)


CASES = {
    # relative residual changes 0.2-0.45: 0.5 reuses 4 of the 6 steps, 0.3 some, 0.05 none
    "qwen_image": Case(QwenImageAdapter, {"prompt": "a cat", "num_inference_steps": STEPS, "height": 64, "width": 64},
                       lambda t: t.transformer_blocks[-1].txt_mlp, diffusers_cache, 0.5, (0.3, 0.5, 0.5),
                       (0.5, 0.05, 0.3)),
    # changes 0.36-0.49 relative to the first step's: 0.5 reuses all 5 later steps, 0.4 some, 0.3 none
    "flux": Case(FluxAdapter, {"prompt": "a cat", "num_inference_steps": STEPS, "height": 64, "width": 64,
                               "max_sequence_length": 32},
                 lambda t: t.single_transformer_blocks[-1].norm.linear, diffusers_cache, 0.4, (0.3, 0.5, 0.4),
                 (0.5, 0.05, 0.4)),
    # changes 0.30-0.53 relative to the first step's: 0.6 reuses all 5 later steps, 0.4 some, 0.2 none
    # (guidance_scale 1: no CFG)
    "sd3": Case(SD3Adapter, {"prompt": "a cat", "num_inference_steps": STEPS, "height": 64, "width": 64,
                             "guidance_scale": 1.0},
                lambda t: t.transformer_blocks[-1].norm1.linear, sd3_first_block_cache, 0.4, (0.2, 0.6, 0.4),
                (0.6, 0.2, 0.4)),
}
SMALL = {"height": 32, "width": 48}  # the other size of a packed forward


def cached(pipeline: str, value: float, seed: int = 3, **extra) -> dict:
    """The pipeline's base inputs with the cache on at `value`."""
    return cached_inputs(CASES[pipeline].base, value, seed, **extra)


@pytest.fixture(scope="module")
def load():
    """Each pipeline's tiny adapter, loaded once (`lora`: the same pipe with the toy LoRAs and mixed sizes)."""
    loaded = {}

    def get(pipeline: str, lora: bool = False):
        if pipeline not in loaded:
            loaded[pipeline] = load_tiny_adapter(pipeline, CASES[pipeline].adapter_class)
        if lora and (pipeline, "lora") not in loaded:
            loaded[pipeline, "lora"] = lora_runner(loaded[pipeline], pipeline)
        return loaded[pipeline, "lora"] if lora else loaded[pipeline]
    return get


@pytest.fixture
def adapter(load, pipeline):
    return load(pipeline)


@pytest.fixture
def tail_rows(adapter, pipeline):
    """Rows entering the pipeline's tail block, per call (not called for a forward the cache skips)."""
    yield from rows_into(CASES[pipeline].tail(adapter.pipe.transformer))


@pytest.mark.parametrize("pipeline", CASES)
def test_inputs_are_declared_per_row_and_checked(adapter, pipeline):
    base = CASES[pipeline].base
    assert {"cache", "cache_threshold"} <= {spec.name for spec in adapter.input_specs()}
    p = parse(adapter, {"prompt": "x"})
    assert (p.cache, p.cache_threshold) == (None, None) and not caches(p) and threshold(p) == 0.05
    deployed = adapter.input_schema(EngineConfig.from_parameters(
        {"default_cache": "first_block", "default_cache_threshold": "0.2"})).parse({"prompt": "x"})
    assert caches(deployed) and threshold(deployed) == pytest.approx(0.2)
    assert adapter.step_key(parse(adapter, cached(pipeline, 0.5))) == adapter.step_key(parse(adapter,
                                                                                             {**base, "seed": 3}))
    for name, value in (("cache", "fast"), ("cache_threshold", -1.0), ("cache_threshold", float("nan"))):
        with pytest.raises(InvalidInputError) as info:
            parse(adapter, {"prompt": "x", name: value})
        assert info.value.input_name == name


@pytest.mark.parametrize("pipeline, cfg", [("qwen_image", False), ("qwen_image", True), ("flux", False),
                                           ("flux", True), ("sd3", False)],
                         ids=["qwen_image-no_cfg", "qwen_image-true_cfg", "flux-no_cfg", "flux-true_cfg", "sd3-no_cfg"])
def test_a_solo_request_is_bitwise_diffusers_first_block_cache(adapter, tail_rows, pipeline, cfg):
    """Both paths decide alike and give the same image; with true CFG each branch has its own state
    (diffusers' cache contexts "cond" and "uncond": two forwards, so cfg_batching off). SD3's CFG is one forward
    of both halves: the next test."""
    case = CASES[pipeline]
    inputs = cached(pipeline, case.solo, **(dict(negative_prompt="bad quality", true_cfg_scale=4.0) if cfg else {}))
    check_solo_is_the_hooks(adapter, tail_rows, inputs, case.hook, pipeline, cfg)


@pytest.mark.parametrize("pipeline", ["sd3"])
def test_with_cfg_each_branch_decides_alone_in_one_forward_or_two(adapter, tail_rows, pipeline):
    """SD3 runs CFG as one forward of [uncond; cond] rows (cfg_batching, the default) whose branches decide
    alone, as they do in two forwards: the same decisions and images within the float bound."""
    inputs = cached(pipeline, 0.4, guidance_scale=5.0)
    one = solo_steps(adapter, inputs, float_output=True)
    one_rows = sum(tail_rows)
    tail_rows.clear()
    two = solo_steps(with_cfg_batching(adapter, False), inputs, float_output=True)
    assert one_rows == len(tail_rows) < 2 * STEPS
    assert image_diff(one, two) <= FLOAT_BOUND


@pytest.mark.parametrize("sizes", ["one_size", "mixed_sizes"])
@pytest.mark.parametrize("pipeline", CASES)
def test_rows_decide_alone_in_a_shared_batch_and_reusing_rows_skip_the_blocks(adapter, tail_rows, pipeline, sizes):
    """Four requests (the cache off and three thresholds) joining at ticks 0-2 share every forward, of one size or
    packed (mixed_size_batching): each image is within one uint8 level of its solo run, and the tail block sees
    exactly the rows whose own request and branch computed there solo (the same decisions, made per row)."""
    mixed = sizes == "mixed_sizes"
    runner = with_parameters(adapter, mixed_size_batching=mixed)
    small = SMALL if mixed else {}
    a, b, c = CASES[pipeline].shared
    requests = {"off": {**CASES[pipeline].base, "seed": 1, **small}, "a": cached(pipeline, a, seed=2),
                "b": cached(pipeline, b, seed=3, **small), "c": cached(pipeline, c, seed=4)}
    check_rows_decide_alone(runner, tail_rows, requests, f"{pipeline} {sizes}")


@pytest.mark.parametrize("pipeline", ["qwen_image"])
def test_a_paused_cached_request_resumes_as_if_never_paused_and_abort_frees_its_cache(adapter, pipeline):
    """Paused after two steps while another cached request runs to its end, then resumed: the same image as
    its uninterrupted run. Its cache moves with its state (every tensor, and back), and freeing the state
    (an abort) releases the cached residuals."""
    check_pause_resume_and_abort(adapter, parse(adapter, cached(pipeline, 0.5, seed=5)), STEPS,
                                 parse(adapter, cached(pipeline, 0.5, seed=6, num_inference_steps=3)), 3, {"cond"})


@pytest.mark.parametrize("pipeline, sizes", [("qwen_image", "one_size"), ("qwen_image", "mixed_sizes"),
                                             ("flux", "one_size"), ("flux", "mixed_sizes"), ("sd3", "mixed_sizes")])
def test_rows_that_compute_alone_keep_their_own_lora(load, tail_rows, pipeline, sizes):
    """The rows that run the later blocks on their own carry their own LoRA (toy_a, none, toy_b), one size or
    packed: each image within one uint8 level of its solo run."""
    a, plain, b = CASES[pipeline].lora
    requests = {"a": cached(pipeline, a, seed=2, lora_name="toy_a"), "plain": cached(pipeline, plain, seed=3),
                "b": cached(pipeline, b, seed=4, lora_name="toy_b", **({"height": 32} if sizes != "one_size" else {}))}
    check_shared_batch(load(pipeline, lora=True), tail_rows, requests, ((0, "a"), (0, "plain"), (1, "b")))
    assert sum(tail_rows) < STEPS * len(requests)


@pytest.mark.parametrize("pipeline", ["qwen_image", "flux"])
def test_a_decision_at_the_thresholds_edge_is_diffusers(adapter, tail_rows, pipeline):
    """Thresholds just under, at and just over the second step's measured change: it computes only under it, and
    each run decides as diffusers' hook does (3 steps)."""
    check_decisions_at_the_edge(adapter, tail_rows, {**CASES[pipeline].base, "num_inference_steps": 3}, pipeline)


@pytest.mark.parametrize("pipeline", ["qwen_image"])
def test_the_metrics_count_decisions_not_rows(adapter, tail_rows, pipeline):
    """num_images 2 with true CFG in one forward: 4 rows, 2 decisions (one per branch) per step. The adapter's
    counts (diffusion_cache_steps_total's source) add up to those decisions, and each computing one sends its 2
    rows through the last block."""
    inputs = cached(pipeline, 0.5, num_images=2, negative_prompt="bad quality", true_cfg_scale=4.0)
    before = adapter.counters()
    solo_steps(adapter, inputs)
    computed, reused = (adapter.counters()[k] - before[k] for k in ("cache_steps_computed", "cache_steps_reused"))
    print(f"qwen_image num_images 2, true CFG: {computed} decisions computed, {reused} reused")
    assert computed + reused == 2 * STEPS and reused >= 1
    assert sum(tail_rows) == 2 * computed
