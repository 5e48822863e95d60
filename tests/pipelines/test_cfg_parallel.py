"""CFG-parallel Qwen-Image: the cond rows on rank 0, the uncond rows on rank 1 (two CPU worker processes over
gloo), and with sequence_parallel_size=2 on two groups of two ranks that split each forward's tokens, against the
single-process adapter on the tiny model.

One worker group of each serves the module; the last two tests kill one of the first's workers, then close it
(run in another order, a later test starts new workers).
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine_lib.config import ConfigError, EngineConfig
from engine_lib.parallel import WorkerError
from engine_lib.pipelines import cfg_parallel
from engine_lib.pipelines.qwen_image.adapter import QwenImageAdapter
from engine_lib.pipelines.tiny_models import ensure_model
from tests.helpers.parity_checks import load_tiny_adapter, parse, step_latents, with_cfg_batching
from tests.helpers.rank_checks import CFG, assert_same_cached_run, assert_same_run, mixed_loras_and_caches
from tests.helpers.step_cache_checks import head_and_tail, rank_rows, rows_through

DETECTION_LIMIT_S = 15  # a dead worker must fail the tick, never hang it: a hang fails the test after this


@pytest.fixture(scope="module")
def single() -> QwenImageAdapter:
    return load_tiny_adapter("qwen_image", QwenImageAdapter)


@pytest.fixture(scope="module")
def two_forwards(single) -> QwenImageAdapter:
    """cfg_batching off: cond and uncond as two forwards of B rows, the forwards the ranks run (the pipe's one LoRA
    library: a second would load the same LoRAs into it again)."""
    adapter = with_cfg_batching(single, False)
    adapter.loras = single.loras
    return adapter


@pytest.fixture(scope="module")
def loaded() -> QwenImageAdapter:
    from engine_lib.pipelines.registry import load_adapter

    config = EngineConfig.of(model_path=str(ensure_model("qwen_image", "tiny")), device="cpu", dtype="float32",
                             cfg_parallel=True)
    adapter = load_adapter(config)
    yield adapter
    adapter.close()


@pytest.fixture
def parallel(loaded) -> QwenImageAdapter:
    """The module's adapter and workers; new workers after a test that killed or closed them (in file order those
    tests come last)."""
    if loaded.workers.broken:
        loaded.close()
        loaded.workers = cfg_parallel.start(type(loaded), str(ensure_model("qwen_image", "tiny")), loaded.device,
                                              loaded.dtype, loaded.config)
    return loaded


@pytest.fixture(scope="module")
def groups_of_two() -> QwenImageAdapter:
    """cfg_parallel with sequence_parallel_size=2: four ranks, the cond forward's tokens on ranks 0 and 1, the
    uncond forward's on ranks 2 and 3."""
    from engine_lib.pipelines.registry import load_adapter

    config = EngineConfig.of(model_path=str(ensure_model("qwen_image", "tiny")), device="cpu", dtype="float32",
                             cfg_parallel=True, sequence_parallel_size=2)
    adapter = load_adapter(config)
    yield adapter
    adapter.close()


def test_a_solo_request_equals_the_single_process_run(parallel, single, two_forwards):
    """With true CFG, then without (rank 0's cond forward alone)."""
    p = parse(single, dict(prompt="a red cube", num_inference_steps=3, seed=5, **CFG))
    assert_same_run(parallel, single, two_forwards, {"solo": (0, p)})
    plain = parse(single, dict(prompt="fruit", num_inference_steps=2, seed=7, height=32, width=48))
    assert_same_run(parallel, single, two_forwards, {"plain": (0, plain)})


def test_a_step_batch_joined_at_different_ticks_equals_the_single_process_run(parallel, single, two_forwards):
    arrivals = {f"r{i}": (i, parse(single, dict(prompt=prompt, num_inference_steps=steps, seed=i, **CFG)))
                for i, (prompt, steps) in enumerate([("a cat", 3), ("a red car on a long road", 2), ("fruit", 3)])}
    assert_same_run(parallel, single, two_forwards, arrivals)


def test_the_ranks_devices_are_checked():
    """(What cfg_parallel does not combine with: test_capabilities.py.)"""
    assert EngineConfig.from_parameters({"cfg_parallel": "true"}).parallel.cfg_parallel
    with pytest.raises(ConfigError, match="'devices'"):
        EngineConfig.of(cfg_parallel=True, devices="cpu")


def test_mixed_loras_and_step_caches_joined_at_different_ticks_equal_the_single_process_run(parallel, single,
                                                                                           two_forwards):
    """Each row's LoRA on both ranks, each branch's cache on its rank, freed there when the request ends."""
    assert_same_cached_run(parallel, single, two_forwards, mixed_loras_and_caches(single))


def test_groups_of_sequence_parallel_ranks_equal_the_single_process_run_solo_and_joined_with_loras_and_caches(
        groups_of_two, single, two_forwards):
    """Four ranks: each CFG group splits its forward's tokens over its two ranks (an all_to_all of its own), rank 0
    joins each group's shards and combines the two predictions. A solo request at 24x24 pixels (9 image tokens: 5
    and 4 per group), then mixed LoRAs and both step caches joining at different ticks: each group's ranks keep
    their share of its branch's caches and decide over the group's tokens, as one process decides. A request
    without CFG runs on the first group alone."""
    solo = parse(single, dict(prompt="a red cube", num_inference_steps=2, seed=5, height=24, width=24, **CFG))
    assert_same_run(groups_of_two, single, two_forwards, {"solo": (0, solo)}, exact=False)
    plain = parse(single, dict(prompt="fruit", num_inference_steps=2, seed=7, height=32, width=48))  # no CFG: the
    assert_same_run(groups_of_two, single, two_forwards, {"plain": (0, plain)}, exact=False)  # first group alone
    names, arrivals = head_and_tail(single), mixed_loras_and_caches(single)
    before = rank_rows(groups_of_two, names)
    assert_same_cached_run(groups_of_two, single, two_forwards, arrivals, exact=False)
    ran = [{name: now[name] - then[name] for name in names}
           for now, then in zip(rank_rows(groups_of_two, names), before)]
    with rows_through(two_forwards, names) as rows:  # (its pipe is the batched adapter's: counted on its own)
        step_latents(two_forwards, arrivals)
    # the block evaluations the first-block cache skipped: each group's ranks alike, the two groups' as one process's
    head, tail = names
    assert ran[0] == ran[1] and ran[2] == ran[3] and rows[head] > rows[tail]
    assert {name: ran[0][name] + ran[2][name] for name in names} == rows


def test_a_killed_worker_fails_the_next_tick_without_hanging(parallel, single):
    rank1 = parallel.workers.processes[1]
    os.kill(rank1.pid, signal.SIGKILL)
    rank1.join(10)
    p = parse(single, dict(prompt="a red cube", num_inference_steps=2, seed=5, **CFG))
    pool = ThreadPoolExecutor(1)
    try:  # (a hung tick is left behind: closing the group ends it)
        tick = pool.submit(step_latents, parallel, {"r": (0, p)})
        with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) died"):
            tick.result(timeout=DETECTION_LIMIT_S)
    finally:
        pool.shutdown(wait=False)
    with pytest.raises(WorkerError, match="broken"):  # and every later tick, at once
        step_latents(parallel, {"r": (0, p)})


def test_close_leaves_no_worker_process_and_no_shared_memory(loaded):
    """(After the kill above, the group closed is the broken one: its survivor must end too.)"""
    processes = loaded.workers.processes
    loaded.close()
    assert not any(process.is_alive() for process in processes)
    for process in processes:
        with pytest.raises(ProcessLookupError):  # reaped, not a zombie
            os.kill(process.pid, 0)
    pids = {str(process.pid) for process in processes} | {str(os.getpid())}
    assert not [name for name in os.listdir("/dev/shm") if set(name.split("_")) & pids]
