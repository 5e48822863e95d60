"""What the first-block cache tests of every pipeline share (test_step_cache*.py).

A hook on a module of the cache's tail block counts the rows that run it per call (it sees one row per row the
block runs, packed image streams too, and is not called for a forward the cache skips), so the tests count the
work a decision saves instead of timing it.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref

from unittest import mock

import numpy as np
import torch
from diffusers.hooks.first_block_cache import FBCHeadBlockHook

from engine_lib.pipelines.base import PipelineAdapter, move_tensors
from engine_lib.pipelines.step_cache import threshold
from engine_lib.request import DiffusionRequest, SamplingParams
from engine_lib.runner import ModelRunner
from engine_lib.pipelines.step_cache import threshold
from tests.helpers.parity_checks import (FLOAT_BOUND, Arrival, image_diff, parse, run_steps, solo_steps,
                                         with_cfg_batching)

STEPS = 6


def rows_into(module):
    """For a fixture: the rows entering `module`, one entry per call."""
    calls = []
    handle = module.register_forward_pre_hook(lambda m, args: calls.append(args[0].shape[0]))
    yield calls
    handle.remove()


def cached_inputs(base: dict, threshold: float, seed: int = 3, **extra) -> dict:
    """`base` with the first-block cache at `threshold`."""
    return {**base, "seed": seed, "cache": "first_block", "cache_threshold": threshold, **extra}


@contextlib.contextmanager
def diffusers_cache(transformer, threshold: float):
    """diffusers' own hook (`enable_cache(FirstBlockCacheConfig)`), on a pipeline whose transformer has it."""
    from diffusers.hooks import FirstBlockCacheConfig

    transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    try:
        yield
    finally:
        transformer.disable_cache()


def check_solo_is_the_hooks(adapter: PipelineAdapter, tail_rows: list, inputs: dict, hook, label: str,
                            cfg: bool = False) -> None:
    """A solo request decides as the pipeline under `hook(transformer, threshold)` does (the same rows through
    the tail block per call, at least one step reused) and gives the same image bitwise. With true CFG
    (`cfg`) each branch has its own state: two forwards (cfg_batching off) against the pipeline's cache
    contexts "cond" and "uncond", then one forward of 2 rows (the default) with the same decisions, each
    branch its own, within the float bound."""
    ours = solo_steps(with_cfg_batching(adapter, not cfg), inputs, float_output=True)
    ours_rows = list(tail_rows)
    tail_rows.clear()
    p = parse(adapter, inputs)
    with hook(adapter.pipe.transformer, threshold(p)):
        reference = adapter.pipe(**adapter.pipe_kwargs(p), output_type="np").images
    reference_rows = list(tail_rows)
    branches = 2 if cfg else 1
    skipped = STEPS * branches - len(reference_rows)
    print(f"{label} first_block {threshold(p):g}, {STEPS} steps x {branches} branches: the hook reused {skipped}")
    assert skipped >= 1 and ours_rows == reference_rows
    assert np.array_equal(ours, reference)
    if cfg:
        tail_rows.clear()
        assert image_diff(solo_steps(adapter, inputs, float_output=True), reference) <= FLOAT_BOUND
        assert sum(tail_rows) == len(reference_rows)


@contextlib.contextmanager
def hook_decisions():
    """diffusers' head hook's decisions, each as (relative change of the first block's residual, computes); its
    first step (no previous residual) is left out."""
    decisions, decide = [], FBCHeadBlockHook._should_compute_remaining_blocks

    def recording(hook, residual):
        prev = hook.state_manager.get_state().head_block_residual
        computes = decide(hook, residual)
        if prev is not None:
            decisions.append((((residual - prev).abs().mean() / prev.abs().mean()).item(), computes))
        return computes

    with mock.patch.object(FBCHeadBlockHook, "_should_compute_remaining_blocks", recording):
        yield decisions


def check_decisions_at_the_edge(adapter: PipelineAdapter, tail_rows: list, inputs: dict, label: str) -> None:
    """Thresholds at 0.999, 1 and 1.001 times the relative change diffusers' hook measures at the second step:
    the step computes only under the first (diffusers computes above the threshold, reuses at or below it), and
    a solo request decides as the hook does at each of them (the same rows through the tail block, the same
    image bitwise)."""
    p = parse(adapter, cached_inputs(inputs, 0.0))
    with hook_decisions() as measured, diffusers_cache(adapter.pipe.transformer, 0.0):
        adapter.pipe(**adapter.pipe_kwargs(p), output_type="np")
    edge = measured[0][0]
    print(f"{label}: the second step's relative change {edge!r}")
    for scale, computes in ((0.999, True), (1.0, False), (1.001, False)):
        request = cached_inputs(inputs, float(np.float32(edge * scale)))
        tail_rows.clear()
        ours = solo_steps(adapter, request, float_output=True)
        ours_rows = list(tail_rows)
        tail_rows.clear()
        p = parse(adapter, request)
        with hook_decisions() as decisions, diffusers_cache(adapter.pipe.transformer, threshold(p)):
            reference = adapter.pipe(**adapter.pipe_kwargs(p), output_type="np").images
        assert decisions[0][1] is computes, (scale, decisions)
        assert ours_rows == list(tail_rows), scale
        assert np.array_equal(ours, reference), scale


def check_shared_batch(runner: PipelineAdapter, tail_rows: list, requests: dict, ticks: tuple,
                       **drive) -> tuple[dict, dict]:
    """Each request solo, then all of them joining at `ticks` ((tick, request id)): every forward holds them all
    (none retried alone) and each image is within one uint8 level of its solo run. Returns each request's rows
    through the tail block solo and the cache decisions the shared run counted for the metrics; `tail_rows`
    then holds the shared run's rows."""
    solo_rows, solo = {}, {}
    for rid, inputs in requests.items():
        tail_rows.clear()
        solo[rid] = solo_steps(runner, inputs)
        solo_rows[rid] = sum(tail_rows)
    tail_rows.clear()
    before = runner.counters()
    result = run_steps(runner, [Arrival(t, rid, requests[rid]) for t, rid in ticks], **drive)
    assert max(result.forward_sizes) == len(requests) and result.forward_sizes == result.batch_sizes
    for rid, image in result.images.items():
        assert np.abs(image.astype(int) - solo[rid].astype(int)).max() <= 1, rid
    counts = {k: runner.counters()[k] - before[k] for k in ("cache_steps_computed", "cache_steps_reused")}
    return solo_rows, counts


def check_rows_decide_alone(runner: PipelineAdapter, tail_rows: list, requests: dict, label: str) -> None:
    """`requests` "off" (the cache off), "a", "b" (which reuses solo) and "c" join at ticks 0, 0, 1 and 2 and
    share every forward (`check_shared_batch`): the tail block sees exactly the rows whose own request and branch
    computed there solo, and the metrics count one decision per caching request and step."""
    solo_rows, counts = check_shared_batch(runner, tail_rows, requests, ((0, "off"), (0, "a"), (1, "b"), (2, "c")),
                                           capacity=4)
    print(f"{label}: rows through the tail block {sum(tail_rows)} of {STEPS * len(requests)}; solo: {solo_rows}")
    assert solo_rows["off"] == STEPS and solo_rows["b"] < STEPS
    assert sum(tail_rows) == sum(solo_rows.values())
    computed = sum(solo_rows.values()) - solo_rows["off"]  # the request without the cache makes no decision
    assert counts == {"cache_steps_computed": computed, "cache_steps_reused": 3 * STEPS - computed}


def check_pause_resume_and_abort(adapter: PipelineAdapter, inputs: SamplingParams, steps: int,
                                 other: SamplingParams, other_steps: int, branches: set[str]) -> None:
    """Paused after two steps while `other` (cached too) runs to its end, then resumed: the same image as its
    uninterrupted run. Its cache (residuals of each of `branches`) moves with its state, every tensor, and
    freeing the state (an abort) releases the cached residuals."""
    expected = solo_steps(adapter, inputs)
    runner = ModelRunner(adapter)
    paused, other = DiffusionRequest("p", inputs, num_steps=steps), DiffusionRequest("o", other, num_steps=other_steps)
    runner.execute_step([paused], [])
    runner.execute_step([], [paused])
    runner.pause(["p"])
    cache = runner.states["p"].step_cache
    assert set(cache) == branches
    assert all(cache[b].head_residual is not None and cache[b].tail_residual is not None for b in branches)
    moved = move_tensors(copy.deepcopy(runner.states["p"]), torch.device("meta"))  # a GPU pause: to the host
    assert {t.device.type for b in branches for t in (moved.step_cache[b].head_residual,
                                                      moved.step_cache[b].tail_residual)} == {"meta"}
    runner.execute_step([other], [])
    while "o" in runner.states:
        runner.execute_step([], [other])
    out = None
    while out is None:
        out = runner.execute_step([], [paused]).outputs.get("p")
    assert np.array_equal(out["image"], expected)

    runner.execute_step([DiffusionRequest("x", inputs, num_steps=steps)], [])
    residuals = [weakref.ref(runner.states["x"].step_cache[b].head_residual) for b in branches]
    runner.free(["x"])  # what an abort does
    gc.collect()
    assert all(residual() is None for residual in residuals) and not runner.states


def first_layer_cache(run_layers, num_layers: int, limit: float, decisions, state: dict, image_tokens):
    """A `run_layers(hidden, rows, which)` for one branch's forwards of a decoder without a diffusers hook
    (BAGEL, HunyuanImage-3.0): diffusers' FirstBlockCache math around the first layer, over the row's image tokens
    (`image_tokens(n)`: their index in the hidden states, n the row's count), kept in `state` across steps;
    `decisions` counts "computed" and "reused"."""
    def layers(hidden, rows, which):
        at = image_tokens(rows.counts[0])
        head = run_layers(hidden, rows, range(1))
        residual = (head - hidden)[at]
        prev = state.get("head")
        if prev is not None and ((residual - prev).abs().mean() / prev.abs().mean()).item() <= limit:
            decisions["reused"] += 1
            out = head.clone()
            out[at] = state["tail"] + head[at]
            return out
        decisions["computed"] += 1
        out = run_layers(head, rows, range(1, num_layers))
        state.update(head=residual, tail=out[at] - head[at])
        return out
    return layers


def with_parameters(adapter: PipelineAdapter, **parameters) -> PipelineAdapter:
    """The same pipe with these config parameters over its own."""
    return type(adapter)(adapter.pipe, adapter.device, adapter.dtype, adapter.config.replace(**parameters))


def lora_runner(adapter: PipelineAdapter, pipeline: str) -> PipelineAdapter:
    """The same pipe with the toy LoRAs and mixed_size_batching (one LoRA library per pipe)."""
    from engine_lib.pipelines.tiny_models import ensure_loras, ensure_model

    loras = ensure_loras(pipeline, ensure_model(pipeline, "tiny"))
    return with_parameters(adapter, lora_dir=str(loras), mixed_size_batching=True)


def head_and_tail(adapter: PipelineAdapter) -> tuple[str, str]:
    """Submodules of the first-block cache's head and tail blocks that see one row per row the block runs (as the
    tails of test_step_cache.py's cases pick them), by name."""
    transformer = adapter.pipe.transformer
    if adapter.name == "flux":
        return "transformer_blocks.0.norm1.linear", \
            f"single_transformer_blocks.{len(transformer.single_transformer_blocks) - 1}.norm.linear"
    return "transformer_blocks.0.txt_mlp", f"transformer_blocks.{len(transformer.transformer_blocks) - 1}.txt_mlp"


@contextlib.contextmanager
def rows_through(adapter: PipelineAdapter, names: tuple[str, ...]):
    """The rows entering each of the transformer's submodules `names` in this process while the block runs, summed
    (as a parallel rank counts them: `rank_states.RankHandler.rows_into`)."""
    counts = dict.fromkeys(names, 0)
    handles = []
    for name in names:
        def count(module, args, name=name):
            counts[name] += args[0].shape[0]

        handles.append(adapter.pipe.transformer.get_submodule(name).register_forward_pre_hook(count))
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def rank_rows(parallel: PipelineAdapter, names: tuple[str, ...]) -> list[dict]:
    """Each of a parallel adapter's ranks' rows into the transformer's submodules `names` so far, rank by rank."""
    n = parallel.workers.world_size
    per_name = {name: parallel.workers.call_all("rows_into", [(name,)] * n) for name in names}
    return [{name: per_name[name][rank] for name in names} for rank in range(n)]
