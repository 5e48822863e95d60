"""HunyuanImage-3.0 over two CPU ranks (gloo): tensor parallel with the experts spread over the ranks
(`expert_parallel`) and with each expert split, against the single-process adapter on the tiny model.

One worker group per layout serves the module: `ep` for every check, `tp` (whose ranks differ only in the expert
slices they load) for the step batch's parity and the shard sizes.

A think / recaption text phase runs on the ranks too (its KV cache split by head like a prompt's, the logits
from the vocabulary-split text head): the same text as one process, greedy and sampled, and the image within
1 level; the bytes each rank holds are half the single process's KV caches at every tick. So does the first-block
cache, its residuals kept on the ranks: the same decisions as one process, alone and beside a think.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
import torch

from engine_lib.config import ConfigError, EngineConfig
from engine_lib.engine import DiffusionEngine
from engine_lib.interface import to_uint8
from engine_lib.pipelines.decoder_parts import held_bytes
from engine_lib.pipelines.hunyuan_image3 import tensor_parallel
from engine_lib.pipelines.hunyuan_image3.adapter import HunyuanImage3Adapter
from engine_lib.pipelines.hunyuan_image3.model import HunyuanConfig, read_config
from engine_lib.pipelines.registry import load_adapter
from engine_lib.request import DiffusionRequest, InvalidInputError
from engine_lib.runner import ModelRunner
from engine_lib.pipelines.tiny_models import ensure_model
from tests.helpers.parity_checks import (Arrival, load_tiny_adapter, parse, run_arrivals, run_ticks, step_engine,
                                         step_latents)
from tests.helpers.waiting import wait_until

LATENT_BOUND = 1e-5
SPLIT = ("self_attn.qkv_proj", "self_attn.o_proj", "shared_mlp", "experts", "model.wte")  # the parts split over the ranks


def inputs(prompt: str, seed: int, steps: int = 3, size=(64, 64), guidance_scale: float = 5.0) -> dict:
    return dict(prompt=prompt, seed=seed, num_inference_steps=steps, height=size[0], width=size[1],
                guidance_scale=guidance_scale, flow_shift=3.0)


RUNS = {  # request id -> (tick it joins at, its inputs)
    "solo": {"solo": (0, inputs("a red cube on a blue floor", 1))},
    "batch": {"r0": (0, inputs("a cat", 2)),
              # guidance_scale 1: one row, one cache; another size
              "r1": (1, inputs("a green sphere next to a yellow cone", 3, steps=2, size=(48, 80), guidance_scale=1.0)),
              "r2": (2, inputs("fruit", 4, guidance_scale=3.5))},
}


@pytest.fixture(scope="module")
def single() -> HunyuanImage3Adapter:
    return load_tiny_adapter("hunyuan_image3", HunyuanImage3Adapter)


@pytest.fixture(scope="module")
def expected(single) -> dict:
    """The single-process run of each of RUNS, made once for both layouts."""
    return {name: step_latents(single, {rid: (at, parse(single, p)) for rid, (at, p) in run.items()})
            for name, run in RUNS.items()}


def load(expert_parallel: bool) -> HunyuanImage3Adapter:
    model_path = str(ensure_model("hunyuan_image3", "tiny"))
    return load_adapter(EngineConfig.of(pipeline="hunyuan_image3", model_path=model_path, device="cpu", dtype="float32",
                                        tensor_parallel_size=2, expert_parallel=expert_parallel))


@pytest.fixture(scope="module")
def ep() -> HunyuanImage3Adapter:
    """TP=2 with EP=2: every check runs on it."""
    adapter = load(True)
    yield adapter
    adapter.close()


@pytest.fixture(scope="module")
def tp() -> HunyuanImage3Adapter:
    """TP=2, each expert split: checked for parity and shard sizes."""
    adapter = load(False)
    yield adapter
    adapter.close()


def held(adapter, what: str = "held_states", *args) -> list[int]:
    """Each rank's count of KV caches held (`held_bytes`: the bytes of those, of the first-block residuals and of
    the padded copies the ranks keep for the next forward; `held_bytes`, False: without those copies)."""
    return adapter.workers.call_all(what, [args] * adapter.workers.world_size)


@pytest.mark.parametrize("layout,run", [("ep", "solo"), ("ep", "batch"), ("tp", "batch")])
def test_every_step_equals_the_single_process_run(request, layout, expected, run):
    """Solo, and three requests joining a step batch at different ticks (with and without CFG, two sizes): every
    step's latents within LATENT_BOUND, the images within 1 uint8 level; each finished request's caches freed, and
    the padded copies of them the ranks kept for the next forward."""
    parallel = request.getfixturevalue(layout)
    calls = parallel.workers.calls
    latents, images = step_latents(parallel, {rid: (at, parse(parallel, p)) for rid, (at, p) in RUNS[run].items()})
    expected_latents, expected_images = expected[run]
    for rid in RUNS[run]:
        assert latents[rid].shape == expected_latents[rid].shape
        assert np.abs(latents[rid] - expected_latents[rid]).max() <= LATENT_BOUND, rid
        levels = np.abs(to_uint8(images[rid]).astype(int) - to_uint8(expected_images[rid]).astype(int))
        assert levels.max() <= 1, rid
    assert parallel.workers.calls > calls and held(parallel) == [0, 0] and held(parallel, "held_bytes") == [0, 0]


@pytest.mark.parametrize("layout", ["ep", "tp"])
def test_a_rank_loads_only_its_shards_and_the_driver_no_transformer(request, layout, single):
    parallel = request.getfixturevalue(layout)
    ranks = parallel.workers.call_all("param_bytes", [()] * 2)
    single_bytes = sum(p.numel() * p.element_size() for m in single.torch_modules() for p in m.parameters())
    transformer = {name: p.numel() * p.element_size() for name, p in single.pipe.model.named_parameters()}
    split = sum(n for name, n in transformer.items() if any(part in name for part in SPLIT))
    print(f"\nparameter bytes: single process {single_bytes} (transformer {sum(transformer.values())}), "
          f"each rank {ranks} ({max(ranks) / single_bytes:.2f}x)")
    assert max(ranks) <= 0.6 * single_bytes
    # every split part exactly halved on each rank, the rest (image in/out, embedders, norms, router) replicated
    assert ranks == [sum(transformer.values()) - split // 2] * 2
    assert isinstance(parallel.pipe.model, tensor_parallel.RankedModel)
    driver = sum(p.numel() * p.element_size() for m in parallel.torch_modules() for p in m.parameters())
    assert driver == sum(p.numel() * p.element_size() for p in single.pipe.vae.parameters())


def test_a_paused_request_keeps_its_caches_on_the_ranks(ep, single):
    """A request preempted by a more urgent one (one seat) keeps its KV shards while paused and ends as alone."""
    slow = Arrival(0, "slow", parse(ep, inputs("a slow boat", 5)), priority=2)
    urgent = Arrival(1, "urgent", parse(ep, inputs("a fast car", 6, steps=2)), priority=1)
    seen = []
    result = run_arrivals(step_engine(ep, capacity=1, float_output=True, max_preemptions=1), [slow, urgent],
                          on_tick=lambda tick: seen.append(held(ep)))
    outputs = result.outputs
    assert result.paused == ["slow"]
    assert seen[:2] == [[2, 2], [4, 4]] and seen[-1] == [0, 0]  # slow's two caches, then urgent's beside them
    _, images = step_latents(single, {"slow": (0, slow.params)})
    levels = np.abs(to_uint8(outputs["slow"]["image"][0]).astype(int) - to_uint8(images["slow"][0]).astype(int))
    assert levels.max() <= 1


def test_a_split_must_divide():
    config = HunyuanConfig.from_json(read_config(ensure_model("hunyuan_image3", "tiny")))
    with pytest.raises(ConfigError, match="num_key_value_heads=2"):
        tensor_parallel.check_split(config, 3, False)
    with pytest.raises(ConfigError, match="num_experts=3"):
        tensor_parallel.check_split(replace(config, num_experts=3), 2, True)


class LeftOpen:
    """The adapter, which an engine closing does not close (the module's other tests keep its workers)."""

    def __init__(self, adapter):
        self._adapter = adapter

    def __getattr__(self, name):
        return getattr(self._adapter, name)

    def close(self) -> None:
        pass


def test_an_aborted_request_frees_every_ranks_caches(ep):
    """Through the engine (a cancel is an abort)."""
    config = EngineConfig.of(pipeline="hunyuan_image3", step_execution=True, warmup=False)
    engine = DiffusionEngine(LeftOpen(ep), config)
    try:
        stream = engine.add_request("long", inputs("a long wait", 7, steps=100))
        assert _wait(lambda: engine.stats().num_runner_states == 1)
        engine.abort(["long"])
        assert stream.result(timeout=60).error is not None
        assert _wait(lambda: engine.stats().num_runner_states == 0)
    finally:
        engine.close()
    assert held(ep) == [0, 0] and held(ep, "held_bytes") == [0, 0]


_wait = functools.partial(wait_until, timeout=60.0)


# -- think and recaption on the ranks -------------------------------------------------------------------------

def text_inputs(task: str, prompt: str, seed: int, max_new_tokens: int, temperature: float = 0.0, **changes) -> dict:
    return dict(inputs(prompt, seed, **changes), bot_task=task, max_new_tokens=max_new_tokens, temperature=temperature)


TEXT_RUNS = {  # request id -> (tick it joins at, its inputs)
    "solo": {"think": (0, text_inputs("think", "the red house !", 3, 12))},
    # a sampled recaption joins while the think decodes; a plain image (no CFG) while both do
    "batch": {"think": (0, text_inputs("think", "the red house !", 3, 12)),
              "recaption": (2, dict(text_inputs("recaption", "cat cube old", 8, 10, temperature=0.7, size=(48, 80),
                                                guidance_scale=3.5), cache="first_block", cache_threshold=0.15)),
              "image": (4, inputs("fruit", 4, guidance_scale=1.0))},
}


def kv_bytes(runner: ModelRunner) -> tuple[int, int]:
    """The bytes a single-process runner's states hold in KV caches (prompt contexts and texts: split by head over
    the ranks) and in first-block cache residuals (whole on every rank)."""
    states = runner.states.values()
    return held_bytes([(s.context, s.text and s.text.cache) for s in states]), held_bytes([s.step_cache for s in states])


@pytest.fixture(scope="module")
def expected_texts(single) -> dict:
    return {name: run_ticks(single, run, kv_bytes) for name, run in TEXT_RUNS.items()}


def assert_same_outputs(outputs: dict, chunks: dict, expected_outputs: dict, expected_chunks: dict) -> None:
    for rid, named in expected_outputs.items():
        if "text" in named:
            assert outputs[rid]["text"][0] == named["text"][0] and chunks[rid] == expected_chunks[rid], rid
            assert outputs[rid]["finish_reason"][0] == named["finish_reason"][0], rid
        levels = np.abs(to_uint8(outputs[rid]["image"][0]).astype(int) - to_uint8(named["image"][0]).astype(int))
        assert levels.max() <= 1, rid


@pytest.mark.parametrize("run", TEXT_RUNS)
def test_think_and_recaption_on_the_ranks_equal_the_single_process(ep, expected_texts, run):
    """Solo, and a greedy think, a recaption sampled at temperature 0.7 (with the first-block cache) and a plain image
    joining at ticks 0, 2 and 4: the same texts (streamed in the same chunks) and finish reasons, each image within
    1 level. At every tick each rank holds exactly half the bytes of the single process's KV caches (its heads'
    share: the text's cache while it decodes, then the image's contexts) and the same first-block residuals, and
    nothing once they end."""
    outputs, chunks, ranks = run_ticks(ep, TEXT_RUNS[run], lambda runner: held(ep, "held_bytes", False))
    expected_outputs, expected_chunks, single_bytes = expected_texts[run]
    assert_same_outputs(outputs, chunks, expected_outputs, expected_chunks)
    print(f"\n{run}: bytes each rank holds, tick by tick {[r[0] for r in ranks]}; one process's KV caches "
          f"{[kv for kv, _ in single_bytes]}, residuals {[res for _, res in single_bytes]}")
    assert ranks == [[kv // 2 + residuals] * 2 for kv, residuals in single_bytes] and single_bytes[0][0] > 0
    assert held(ep) == [0, 0] and held(ep, "held_bytes") == [0, 0]


def test_the_vocabulary_split_head_gives_the_single_process_logits_and_a_forward_run_again_grows_once(ep, single):
    """Every logit, those on both sides of the ranks' vocabulary boundary included, within 1e-5 of one process's.
    The same token's forward run again (a batch retried row by row: the driver still counts the cache's old
    length) gives the same logits and leaves each rank's cache one token longer, not two."""
    context = single.thinker.text_ids("a boundary", "think")
    local = single.thinker.start(context, 4)
    remote = ep.thinker.start(context, 4)
    token = torch.tensor([[context[-1]]])
    try:
        [expected], new = single.thinker.head.logits(single.pipe.model, [local.cache], token)
        [logits] = ep.pipe.model.text_logits([remote.cache], token)
        once = held(ep, "held_bytes")
        [again] = ep.pipe.model.text_logits([remote.cache], token)
    finally:
        ep.pipe.model.free([remote.cache])
    boundary = tensor_parallel.block(single.pipe.model.config.vocab_size, 1, 2).start
    assert logits.shape == expected.shape and 0 < boundary < len(expected)
    assert (logits - expected).abs().max() <= LATENT_BOUND and torch.equal(again, logits)
    grown = held_bytes(single.thinker.head.grown(local.cache, new[0]))
    assert held(ep, "held_bytes") == [0, 0] and once == [grown // 2] * 2


def test_a_text_phase_preempted_on_the_ranks_resumes_and_a_cancelled_one_frees_every_shard(ep, expected_texts):
    """One seat: the think decoding is preempted at tick 2 by an urgent sampled recaption; both give the texts of
    one process, the paused one keeping its text's shards. A request cancelled while decoding frees them on
    every rank."""
    solo, batch = (expected_texts[run][0] for run in ("solo", "batch"))
    slow_p, urgent_p = (parse(ep, TEXT_RUNS["batch"][rid][1]) for rid in ("think", "recaption"))
    seen = []
    result = run_arrivals(step_engine(ep, capacity=1, float_output=True, max_preemptions=1),
                          [Arrival(0, "slow", slow_p, priority=2), Arrival(2, "urgent", urgent_p, priority=1)],
                          on_tick=lambda tick: seen.append(held(ep, "held_bytes")))
    outputs = result.outputs
    assert result.paused == ["slow"] and seen[2][0] > seen[1][0] > 0 and seen[-1] == [0, 0]
    assert outputs["slow"]["text"][0] == solo["think"]["text"][0]
    assert outputs["urgent"]["text"][0] == batch["recaption"]["text"][0]

    runner = ModelRunner(ep, float_outputs=True)
    cancelled = DiffusionRequest("cancelled", slow_p, num_steps=ep.total_steps(slow_p))
    runner.execute_step([cancelled], [])
    runner.execute_step([], [cancelled])
    assert runner.states["cancelled"].decoding and held(ep) == [1, 1]
    runner.free(["cancelled"])
    assert held(ep, "held_bytes") == [0, 0]


# -- the first-block cache on the ranks -----------------------------------------------------------------------

def cached(prompt: str, seed: int, threshold: float, **changes) -> dict:
    return dict(inputs(prompt, seed, **changes), cache="first_block", cache_threshold=threshold)


CACHE_RUNS = {  # the tiny model reuses 3 of 6 steps at 0.15 (seed 3, CFG): test_step_cache_hunyuan_image3.py
    "solo": {"solo": (0, cached("a red cube on a blue floor", 3, 0.15, steps=6))},
    "batch": {"r0": (0, cached("a red cube on a blue floor", 3, 0.15, steps=6)),
              "r1": (1, inputs("a green sphere next to a yellow cone", 4, steps=4, size=(48, 80), guidance_scale=1.0)),
              "r2": (2, cached("fruit", 5, 0.2, steps=5, guidance_scale=1.0))},
}


def decisions(adapter) -> dict:
    return {k: adapter.counters()[k] for k in ("cache_steps_computed", "cache_steps_reused")}


@pytest.fixture(scope="module")
def expected_cached(single) -> dict:
    out = {}
    for name, run in CACHE_RUNS.items():
        before = decisions(single)
        latents, images = step_latents(single, {rid: (at, parse(single, p)) for rid, (at, p) in run.items()})
        out[name] = latents, images, {k: v - before[k] for k, v in decisions(single).items()}
    return out


@pytest.mark.parametrize("run", CACHE_RUNS)
def test_the_first_block_cache_on_the_ranks_decides_as_one_process(ep, expected_cached, run):
    """Solo, and a cached CFG request, an uncached one and one cached at another threshold joining at ticks 0-2:
    the same decisions as one process (some steps reused), every step's latents within LATENT_BOUND, the images
    within 1 level; every rank frees the residuals with the caches."""
    before = decisions(ep)
    latents, images = step_latents(ep, {rid: (at, parse(ep, p)) for rid, (at, p) in CACHE_RUNS[run].items()})
    expected_latents, expected_images, expected_decisions = expected_cached[run]
    assert {k: v - before[k] for k, v in decisions(ep).items()} == expected_decisions
    print(f"\n{run}: decisions on the ranks {expected_decisions}")
    assert expected_decisions["cache_steps_reused"] >= 3
    for rid in CACHE_RUNS[run]:
        assert np.abs(latents[rid] - expected_latents[rid]).max() <= LATENT_BOUND, rid
        levels = np.abs(to_uint8(images[rid]).astype(int) - to_uint8(expected_images[rid]).astype(int))
        assert levels.max() <= 1, rid
    assert held(ep, "held_bytes") == [0, 0]
