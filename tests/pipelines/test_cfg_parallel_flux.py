"""CFG-parallel Flux (true CFG: a negative prompt and true_cfg_scale > 1): the cond rows on rank 0, the uncond rows
on rank 1 (two CPU worker processes over gloo), against the single-process adapter on the tiny model, with the
checks of Qwen-Image's (test_cfg_parallel.py): solo and joining at different ticks, with mixed LoRAs and both step
caches."""

from __future__ import annotations

import pytest

from engine_lib.config import EngineConfig
from engine_lib.pipelines.flux.adapter import FluxAdapter
from engine_lib.pipelines.registry import load_adapter
from engine_lib.pipelines.tiny_models import ensure_model
from tests.helpers.parity_checks import load_tiny_adapter, parse, with_cfg_batching
from tests.helpers.rank_checks import CFG, assert_same_cached_run, assert_same_run, mixed_loras_and_caches

FLUX_CFG = {**CFG, "true_cfg_scale": 3.7}


@pytest.fixture(scope="module")
def single() -> FluxAdapter:
    return load_tiny_adapter("flux", FluxAdapter)


@pytest.fixture(scope="module")
def two_forwards(single) -> FluxAdapter:
    """cfg_batching off: the two forwards of B rows the ranks run (sharing the single adapter's LoRA library)."""
    adapter = with_cfg_batching(single, False)
    adapter.loras = single.loras
    return adapter


@pytest.fixture(scope="module")
def parallel():
    adapter = load_adapter(EngineConfig.of(pipeline="flux", model_path=str(ensure_model("flux", "tiny")), device="cpu",
                                           dtype="float32", cfg_parallel=True))
    yield adapter
    adapter.close()


def test_solo_and_a_step_batch_joined_at_different_ticks_equal_the_single_process_run(parallel, single, two_forwards):
    solo = parse(single, dict(prompt="a red cube", num_inference_steps=3, seed=5, **FLUX_CFG))
    assert_same_run(parallel, single, two_forwards, {"solo": (0, solo)})
    arrivals = {f"r{i}": (i, parse(single, dict(prompt=prompt, num_inference_steps=steps, seed=i, **FLUX_CFG)))
                for i, (prompt, steps) in enumerate([("a cat", 3), ("a red car on a long road", 2), ("fruit", 3)])}
    assert_same_run(parallel, single, two_forwards, arrivals)


def test_mixed_loras_and_step_caches_joined_at_different_ticks_equal_the_single_process_run(parallel, single,
                                                                                           two_forwards):
    """Each row's LoRA on both ranks, each branch's first-block cache and TaylorSeer factors on its rank."""
    arrivals = {rid: (at, parse(single, {**p, "true_cfg_scale": 3.7})) for rid, (at, p) in
                mixed_loras_and_caches(single).items()}
    assert_same_cached_run(parallel, single, two_forwards, arrivals)
