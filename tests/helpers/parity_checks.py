"""Shared parity checks for pipeline adapters: engines the tests step themselves, image comparisons, and
`FlowMatchParitySuite`, the parity tests every flow-matching adapter runs.

Every run is the engine's own tick (`DiffusionEngine.step()`: schedule, execute, update, emit) on an
engine without its busy-loop thread; the tests only submit each arrival before its tick and collect
what each step did.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from engine_lib.config import EngineConfig, SchedulerConfig
from engine_lib.engine import DiffusionEngine
from engine_lib.interface import to_uint8
from engine_lib.pipelines import packing, taylorseer
from engine_lib.pipelines.base import InputBatch, PipelineAdapter
from engine_lib.request import InvalidInputError, SamplingParams
from engine_lib.sched import Scheduler

# Batch-size dependent CPU float32 kernels move pixels by about 1e-6 (measured; see
# docs/pipelines.md); this bound is two orders of magnitude above that.
FLOAT_BOUND = 1e-4
MAX_UINT8_CHANGED_FRACTION = 0.001  # pixels allowed to differ, by at most 1 level
# How much a new prompt must move a tiny model's image at least (100x FLOAT_BOUND): measured in that test 0.023
# (Qwen-Image), 0.025 (Flux), 0.11 (SD3); engine_lib/pipelines/qwen_image/tiny.py says why Qwen-Image's weights
# are scaled to get there.
PROMPT_MOVES = 1e-2


def load_tiny_adapter(pipeline: str, adapter_cls: type) -> PipelineAdapter:
    """The tiny model of `pipeline`, loaded through the registry as the engine loads it (CPU, float32)."""
    from engine_lib.pipelines.registry import load_adapter
    from engine_lib.pipelines.tiny_models import ensure_model

    model_dir = ensure_model(pipeline, "tiny")
    adapter = load_adapter(EngineConfig.of(pipeline=pipeline, model_path=str(model_dir), device="cpu", dtype="float32"))
    assert isinstance(adapter, adapter_cls) and getattr(adapter, "cfg_batching", True)  # on by default
    return adapter


def with_cfg_batching(adapter: PipelineAdapter, on: bool) -> PipelineAdapter:
    """The same pipe and options with cfg_batching `on` (off: cond and uncond as two forwards of B rows)."""
    return type(adapter)(adapter.pipe, adapter.device, adapter.dtype, adapter.config.replace(cfg_batching=on))


@contextlib.contextmanager
def packed_attention_on(transformer, backend: str):
    """Within: the transformer's attention processors on diffusers' `backend` (set on each processor, as the
    `attention_backend` lever leaves them); yields the backend of each packed attention call, one entry a call."""
    processors = [m.processor for m in transformer.modules() if hasattr(m, "processor")]
    saved = [vars(p).get("_attention_backend", _UNSET) for p in processors]
    calls, dispatch = [], packing.dispatch_attention_fn

    def counted(*args, **kwargs):
        calls.append(kwargs["backend"])
        return dispatch(*args, **kwargs)

    for processor in processors:
        processor._attention_backend = backend
    packing.dispatch_attention_fn = counted
    try:
        yield calls
    finally:
        packing.dispatch_attention_fn = dispatch
        for processor, value in zip(processors, saved):
            if value is _UNSET:
                del processor._attention_backend
            else:
                processor._attention_backend = value


_UNSET = object()


@dataclass(frozen=True)
class Arrival:
    tick: int
    request_id: str
    params: Any  # the request's inputs by name (a dict), or parsed SamplingParams
    priority: int = 0  # 1 most urgent (0: the engine's default level)


@dataclass
class DriveResult:
    images: dict[str, np.ndarray] = field(default_factory=dict)  # the first declared output (image, video):
    # uint8, or float32 with float_output
    outputs: dict[str, dict] = field(default_factory=dict)  # request id -> every final output by name
    previews: dict[str, list[tuple[int, np.ndarray]]] = field(default_factory=dict)  # (step, preview)
    batch_sizes: list[int] = field(default_factory=list)  # requests running in each tick
    forward_sizes: list[int] = field(default_factory=list)  # requests in each denoise forward that succeeded (a
    # batch that failed and was retried one by one counts as its single-request forwards)
    finished_at: dict[str, int] = field(default_factory=dict)  # request id -> tick
    errors: dict[str, Exception] = field(default_factory=dict)
    chunks: dict[str, list[dict]] = field(default_factory=dict)  # request id -> its streamed chunks, in order
    paused: list[str] = field(default_factory=list)  # request ids preempted, in order


def step_engine(adapter: PipelineAdapter, capacity: int = 4, float_output: bool = False,
                group_decodes: bool = False, max_preemptions: int = 0) -> DiffusionEngine:
    """An engine without its busy-loop thread (the test calls `step()`), in step mode: requests join between
    steps in arrival order and every request shares one key (the test decides who shares a forward).

    `float_output` keeps the pipeline's float outputs (before the uint8 rounding every served image gets);
    `group_decodes`: the scheduler's decode groups (else each request decodes the tick it finishes denoising);
    `max_preemptions`: times a running request may pause for a more urgent arrival.
    """
    config = SchedulerConfig(step_execution=True, max_num_seqs=capacity, max_preemptions=max_preemptions)
    scheduler = Scheduler(config, lambda params: None, max_head_bypass=0, group_decodes=group_decodes)
    return DiffusionEngine(adapter, TEST_CONFIG, scheduler, run_loop=False, float_outputs=float_output)


def run_arrivals(engine: DiffusionEngine, arrivals: list[Arrival], on_tick=None) -> DriveResult:
    """Submit each arrival before its tick and call `engine.step()` tick by tick until every request has ended;
    what the steps did, collected. Previews follow each request's preview_interval; `on_tick(tick)` runs after
    each step (to look at the runner's states)."""
    adapter = engine.adapter
    result = DriveResult()
    primary = adapter.outputs[0].name  # image, video
    pending = sorted(arrivals, key=lambda a: a.tick)
    tick = 0
    while pending or engine.scheduler.has_requests:
        while pending and pending[0].tick <= tick:
            arrival = pending.pop(0)
            params = parse(adapter, arrival.params)
            engine.add_request(arrival.request_id, params.replace(priority=arrival.priority) if arrival.priority
                               else params)
        plan, out = engine.step()
        result.paused += plan.preempted_ids
        if not plan.is_empty:
            result.batch_sizes.append(len(plan.scheduled_ids))
        if out.forward_size:
            result.forward_sizes += [1] * out.forward_size if out.batch_retries else [out.forward_size]
        for request_id, preview in out.previews.items():
            result.previews.setdefault(request_id, []).append((out.step_index[request_id], preview.get(primary)))
        for request_id, chunk in out.chunks.items():
            result.chunks.setdefault(request_id, []).append(chunk)
        for request_id, outputs in out.outputs.items():
            result.outputs[request_id] = outputs
            result.images[request_id] = outputs.get(primary)
            result.finished_at[request_id] = tick
        result.errors.update(out.errors)
        if on_tick is not None:
            on_tick(tick)
        tick += 1
    assert not result.errors, result.errors
    assert not engine.runner.states, "the runner freed every ended request's state"
    return result


def run_steps(adapter: PipelineAdapter, arrivals: list[Arrival], capacity: int = 4, **engine) -> DriveResult:
    """`arrivals` through a new `step_engine(adapter, capacity, **engine)`."""
    return run_arrivals(step_engine(adapter, capacity, **engine), arrivals)


def run_ticks(adapter, arrivals: dict[str, tuple[int, dict]], measure=lambda runner: None) -> tuple[dict, dict, list]:
    """Raw inputs stepped through an engine, each request joining at its tick (`arrivals`: request id -> (tick,
    inputs)), for adapters with a text phase: the final float outputs, each request's streamed text chunks, and
    `measure(runner)` after every tick (the runner has dropped the states of the requests that ended in it)."""
    engine = step_engine(adapter, capacity=len(arrivals), float_output=True)
    seen = []
    result = run_arrivals(engine, [Arrival(tick, rid, raw) for rid, (tick, raw) in arrivals.items()],
                          on_tick=lambda tick: seen.append(measure(engine.runner)))
    return result.outputs, text_chunks(result), seen


def text_chunks(result: DriveResult) -> dict[str, list[str]]:
    """Each request's streamed `text` chunks, in order."""
    return {rid: [chunk["text"][0] for chunk in chunks] for rid, chunks in result.chunks.items()}


def step_latents(adapter, arrivals: dict[str, tuple[int, Any]]) -> tuple[dict, dict]:
    """The adapter's step contract tick by tick, as the runner calls it (requests join at their tick), for
    adapters whose state keeps `latents`: each request's latents after every step (stacked; a text phase's ticks
    left out, its last one giving the initial noise), and its final image. `arrivals`: request id -> (tick, parsed
    params)."""
    states, latents, images, tick = {}, {}, {}, 0
    while len(images) < len(arrivals):
        for rid, (at, p) in arrivals.items():
            if at == tick:
                state = adapter.new_state(rid, p)
                adapter.prepare_encode(state)
                states[rid] = state
        active = [s for s in states.values() if not s.denoise_completed]
        if active:
            batch = InputBatch.gather(active)
            for state, v in zip(active, batch.split(adapter.denoise_step(batch, states=active))):
                adapter.step_scheduler(state, v)
                if not getattr(state, "decoding", False):
                    latents.setdefault(state.request_id, []).append(state.latents.clone())
        done = [s for s in active if s.denoise_completed]
        for state, out in zip(done, adapter.post_decode(done) if done else []):
            image = out["image"]  # float images, as a tensor on the device or numpy
            images[state.request_id] = image.cpu().numpy() if isinstance(image, torch.Tensor) else image
            adapter.release(state)  # as the runner drops it
        tick += 1
    return {rid: torch.stack(v).numpy() for rid, v in latents.items()}, images


def run_wave(adapter: PipelineAdapter, all_params: list, float_output: bool = False) -> list:
    """Request mode: one wave admitted together and run to completion (`DiffusionEngine.generate`)."""
    engine = DiffusionEngine.wave(adapter, TEST_CONFIG, len(all_params), float_outputs=float_output)
    finals = engine.generate({f"r{i}": parse(adapter, p) for i, p in enumerate(all_params)})
    assert all(final.ok for final in finals.values()), finals
    return [finals[f"r{i}"].outputs[adapter.outputs[0].name] for i in range(len(all_params))]


def image_diff(actual: np.ndarray, expected: np.ndarray) -> float:
    """Max absolute difference of two float images (shapes must match)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float(np.abs(actual.astype(np.float64) - expected.astype(np.float64)).max())


def assert_close_images(actual: np.ndarray, expected: np.ndarray, to_uint8) -> float:
    """Float images within FLOAT_BOUND, and their uint8 forms at most 1 level apart in <= 0.1 % of values.

    Returns the measured max float difference.
    """
    diff = image_diff(actual, expected)
    assert diff <= FLOAT_BOUND, f"max abs diff {diff:.3g} > {FLOAT_BOUND}"
    assert_within_one_level(to_uint8(actual), to_uint8(expected))
    return diff


def assert_within_one_level(actual: np.ndarray, expected: np.ndarray, what: Any = "") -> None:
    """uint8 images at most 1 level apart, in at most MAX_UINT8_CHANGED_FRACTION of their values: what
    batch-size dependent CPU kernels may change. `what` names the image in the failure."""
    levels = np.abs(actual.astype(np.int16) - expected.astype(np.int16))
    assert levels.max() <= 1, f"{what} uint8 images differ by {levels.max()} levels"
    changed = float((levels > 0).mean())
    assert changed <= MAX_UINT8_CHANGED_FRACTION, f"{what} {changed:.3%} of uint8 values differ"


# -- the shared parity suite ---------------------------------------------------------------

PROMPTS = ["a photo of a cat", "a red car", "an astronaut riding a horse on the moon", "a bowl of fruit"]
LONG_PROMPT = "a small dog running in the green grass next to a river"
# What the tests may ask for; every other limit is the shipped default.
TEST_CONFIG = EngineConfig.from_parameters({"max_num_inference_steps": "1000", "max_num_images": "4"})


def parse(adapter: PipelineAdapter, inputs) -> SamplingParams:
    """Inputs validated exactly as the engine validates them at admission (already-parsed params pass through)."""
    if isinstance(inputs, SamplingParams):
        return inputs
    return adapter.input_schema(TEST_CONFIG).parse(inputs)


def pipe_reference(adapter: PipelineAdapter):
    """`pipe(...)` for a request's inputs: its first declared output (image [N, H, W, 3], video
    [N, F, H, W, 3]) as float32, memoised.

    The call is built from the declaration alone (`adapter.pipe_kwargs`), and the
    output read from the pipeline output's declared `pipe_output` attribute.
    """
    image = adapter.outputs[0]

    @functools.lru_cache(maxsize=None)
    def run(p: SamplingParams) -> np.ndarray:
        result = adapter.pipe(**adapter.pipe_kwargs(p), output_type="np")
        images = getattr(result, image.pipe_output)
        images.setflags(write=False)
        return images

    return lambda inputs: run(parse(adapter, inputs))


def solo_steps(adapter, p, **kw):
    return run_steps(adapter, [Arrival(0, "solo", p)], capacity=1, **kw).images["solo"]


class FlowMatchParitySuite:
    """The parity tests every FlowMatchAdapter runs against its own diffusers pipeline.

    Solo runs must be bitwise what `pipe(...)` gives; batched runs may differ only
    by batch-size dependent CPU kernels (FLOAT_BOUND and the uint8 rule of
    `assert_close_images`). Every run goes through the engine's own tick
    (`DiffusionEngine.step()`): `run_wave` is request mode (a wave admitted
    together), `run_steps` step mode (arrivals join between steps).

    A test module subclasses it (as `Test<Pipeline>Parity`) and provides module
    fixtures: `adapter` (`load_tiny_adapter`: through the registry, cfg_batching
    on), `bitwise_adapter` (the cfg_batching setting that is diffusers' own CFG
    execution) and `reference` (`pipe_reference`). Class attributes say how the
    inputs look with and without CFG, and where pipelines differ.
    """

    BASE: ClassVar[dict] = {}  # added to every request's inputs (e.g. a short max_sequence_length)
    NO_CFG: ClassVar[dict] = {}
    CFG: ClassVar[dict] = {}
    SEEDS: ClassVar[tuple] = (0, 1, 2)
    STEPS: ClassVar[tuple] = (3, 5)  # solo step counts; the first also runs the solo cfg_batching check
    # True where prompts of different lengths share a forward padded to the longest (the
    # transformer takes a mask): a longer prompt then changes the other rows' padding.
    PADS_TEXT: ClassVar[bool] = False

    @classmethod
    def params(cls, prompt: str = PROMPTS[0], cfg: bool = False, steps: int = 4, seed: int = 0,
               **kw: Any) -> dict:
        """A request's inputs by name (validated by the driver, as at admission)."""
        return {"prompt": prompt, "num_inference_steps": steps, "seed": seed, "height": 64, "width": 64,
                **cls.BASE, **(cls.CFG if cfg else cls.NO_CFG), **kw}

    @classmethod
    def staggered_arrivals(cls, cfg: bool) -> list[Arrival]:
        """Step counts 8, 6, 5, 3 admitted at ticks 0, 1, 2, 4: four share ticks 4-6, three finish at tick 6."""
        plan = [(0, 8), (1, 6), (2, 5), (4, 3)]
        return [Arrival(tick, f"r{i}", cls.params(PROMPTS[i], cfg=cfg, steps=steps, seed=10 + i))
                for i, (tick, steps) in enumerate(plan)]

    # -- solo parity: bitwise ---------------------------------------------------------

    @pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "cfg"])
    def test_solo_matches_diffusers_bitwise(self, adapter, bitwise_adapter, reference, cfg):
        """One request alone through the runner gives exactly `pipe(...)`'s image (SEEDS x STEPS), as float
        and as the served uint8.

        Without CFG this is the engine's default adapter (cfg_batching does not apply); with CFG it
        is `bitwise_adapter`, and the other CFG execution is checked in the cfg_batching test.
        """
        runner = bitwise_adapter if cfg else adapter
        for seed in self.SEEDS:
            for steps in self.STEPS:
                p = self.params(cfg=cfg, steps=steps, seed=seed)
                expected = reference(p)
                image = solo_steps(runner, p)
                assert image.dtype == np.uint8 and image.shape == (1, 64, 64, 3)
                np.testing.assert_array_equal(image, to_uint8(expected), err_msg=f"uint8, seed {seed}, {steps} steps")
                np.testing.assert_array_equal(solo_steps(runner, p, float_output=True), expected,
                                              err_msg=f"float, seed {seed}, {steps} steps")

    def test_solo_at_the_default_text_length_and_several_images(self, adapter, reference):
        p = {k: v for k, v in self.params(steps=3, seed=5, num_images=2).items() if k != "max_sequence_length"}
        image = solo_steps(adapter, p)
        assert image.shape == (2, 64, 64, 3)
        np.testing.assert_array_equal(image, to_uint8(reference(p)))

    def test_cfg_batching_on_and_off_agree(self, adapter, reference):
        """Both CFG executions (one forward of 2B rows, two of B rows) stay within the bound of each other
        in a staggered step batch, and of diffusers solo (SEEDS at the first of STEPS)."""
        other = with_cfg_batching(adapter, not adapter.cfg_batching)
        arrivals = self.staggered_arrivals(cfg=True)
        one = run_steps(adapter, arrivals, float_output=True).images
        two = run_steps(other, arrivals, float_output=True).images
        diffs = [assert_close_images(one[a.request_id], two[a.request_id], to_uint8) for a in arrivals]
        for seed in self.SEEDS:
            p = self.params(cfg=True, steps=self.STEPS[0], seed=seed)
            for runner in (adapter, other):
                diffs.append(assert_close_images(solo_steps(runner, p, float_output=True), reference(p), to_uint8))
        print(f"{adapter.name} cfg_batching on vs off, and each vs diffusers: max abs diff {max(diffs):.2e}")

    # -- batched parity: within the bound ---------------------------------------------

    @pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "cfg"])
    def test_step_batch_staggered_matches_solo(self, adapter, reference, cfg):
        arrivals = self.staggered_arrivals(cfg)
        result = run_steps(adapter, arrivals, capacity=4, float_output=True)
        assert max(result.forward_sizes) == 4, result.forward_sizes  # different steps and step counts in one forward
        assert result.finished_at == {"r0": 7, "r1": 6, "r2": 6, "r3": 6}
        diffs = [assert_close_images(result.images[a.request_id], reference(a.params), to_uint8) for a in arrivals]
        print(f"{adapter.name} step batch cfg={cfg}: max abs diff per request {['%.2e' % d for d in diffs]}")

    @pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "cfg"])
    def test_request_wave_matches_solo(self, adapter, reference, cfg):
        all_params = [self.params(PROMPTS[i], cfg=cfg, steps=4, seed=20 + i) for i in range(4)]
        images = run_wave(adapter, all_params, float_output=True)
        diffs = [assert_close_images(image, reference(p), to_uint8) for image, p in zip(images, all_params)]
        print(f"{adapter.name} request wave cfg={cfg}: max abs diff per request {['%.2e' % d for d in diffs]}")
        for image, expected in zip(run_wave(adapter, all_params), images):
            np.testing.assert_array_equal(image, to_uint8(expected))

    # -- mixed sizes in one step batch (adapters with `step_key_skips`: Qwen-Image, Flux) ----------

    MIXED = {"padded": [("square-64", 64, 64), ("small-32", 32, 32), ("wide", 32, 64), ("tall", 64, 48)],
             "transposed": [("wide", 32, 64), ("tall", 64, 32)],  # one token count: no padding, other positions
             # token counts repeated and interleaved: rows of one count attend together, out of row order
             "grouped": [("square-64", 64, 64), ("small-32", 32, 32), ("wide", 32, 64), ("tall", 64, 32)]}

    @staticmethod
    def mixed_size_adapter(adapter: PipelineAdapter) -> PipelineAdapter:
        if not adapter.step_key_skips:
            pytest.skip(f"{adapter.name} keeps one image size per forward")
        return type(adapter)(adapter.pipe, adapter.device, adapter.dtype,
                             adapter.config.replace(mixed_size_batching=True))

    def test_with_mixed_size_batching_size_leaves_the_step_key_but_not_the_request_key(self, adapter):
        mixed = self.mixed_size_adapter(adapter)
        small, large = parse(adapter, self.params(height=32, width=32)), parse(adapter, self.params(height=64, width=48))
        assert mixed.step_key(small) == mixed.step_key(large)
        assert mixed.request_key(small) != mixed.request_key(large)
        assert adapter.step_key(small) != adapter.step_key(large)  # the default keeps one size per batch

    @pytest.mark.parametrize("sizes, cfg", [("padded", False), ("padded", True), ("transposed", False),
                                            ("grouped", True)],
                             ids=["padded-no-cfg", "padded-cfg", "transposed", "grouped-cfg"])
    def test_different_sizes_share_a_forward_and_each_matches_its_solo_run(self, adapter, sizes, cfg):
        """Rows of different sizes in one forward, each with its own RoPE (packed or padded, per adapter):
        every image within the batched tolerance of its solo run (which is bitwise diffusers'), staggered
        joins too. Transposed sizes have one token count (nothing to pad) but not the same positions;
        grouped ones repeat token counts out of order."""
        mixed = self.mixed_size_adapter(adapter)
        inputs = {name: self.params(PROMPTS[i], cfg=cfg, height=h, width=w, steps=4, seed=i)
                  for i, (name, h, w) in enumerate(self.MIXED[sizes])}
        together = run_steps(mixed, [Arrival(i % 2, name, p) for i, (name, p) in enumerate(inputs.items())],
                               float_output=True)
        assert max(together.forward_sizes) == len(inputs)  # every size in one forward
        for name, p in inputs.items():
            assert_close_images(together.images[name], solo_steps(mixed, p, float_output=True), to_uint8)

    def test_taylorseer_rows_share_packed_forwards_and_each_matches_its_solo_run(self, adapter):
        """TaylorSeer with mixed sizes: two TaylorSeer requests, one with the first-block cache and a plain one,
        of three token counts, join at ticks 0 and 1, so some packed forwards hold rows that predict next to
        rows that compute (among them a group whose two rows differ): each image within the batched tolerance
        of its solo run, and the tokens through the last attention module what the solo runs put through it."""
        if "taylorseer" not in adapter.capabilities.features:
            pytest.skip(f"{adapter.name} does not run TaylorSeer")
        mixed = self.mixed_size_adapter(adapter)
        seer, first_block = {"cache": "taylorseer"}, {"cache": "first_block", "cache_threshold": 0.3}
        caches = [seer, first_block, seer, {}]
        inputs = {name: self.params(PROMPTS[i], height=h, width=w, steps=4, seed=i, **caches[i])
                  for i, (name, h, w) in enumerate(self.MIXED["grouped"])}
        module = taylorseer.attention_modules(adapter.pipe.transformer)[-1].to_q
        tokens = []
        handle = module.register_forward_pre_hook(lambda m, args: tokens.append(args[0].shape[:-1].numel()))
        try:
            solo = {name: solo_steps(mixed, p, float_output=True) for name, p in inputs.items()}
            solo_tokens = sum(tokens)
            tokens.clear()
            together = run_steps(mixed, [Arrival(i % 2, name, p) for i, (name, p) in enumerate(inputs.items())],
                                   float_output=True)
        finally:
            handle.remove()
        assert max(together.forward_sizes) == len(inputs)
        for name in inputs:
            assert_close_images(together.images[name], solo[name], to_uint8)
        print(f"{adapter.name} packed taylorseer: tokens through the last attention {sum(tokens)}, solo {solo_tokens}")
        assert sum(tokens) == solo_tokens

    # -- isolation ------------------------------------------------------------------------

    @pytest.mark.parametrize("mode", ["wave", "steps"])
    def test_changing_one_request_changes_only_its_image(self, adapter, mode):
        def run(all_params):
            if mode == "wave":
                return run_wave(adapter, all_params, float_output=True)
            arrivals = [Arrival(i, f"r{i}", p) for i, p in enumerate(all_params)]
            result = run_steps(adapter, arrivals, float_output=True)
            return [result.images[f"r{i}"] for i in range(len(all_params))]

        # Step counts 3 and 4 in both modes: the runner drops requests from the batch as they finish.
        base = [self.params(PROMPTS[i], steps=3 + i % 2, seed=30 + i) for i in range(4)]
        before = run(base)

        reseeded = list(base)
        reseeded[1] = {**base[1], "seed": 99}
        after = run(reseeded)
        assert image_diff(after[1], before[1]) > 1e-2, "a new seed did not change its image"
        for j in (0, 2, 3):  # same shapes, same kernels: bitwise unchanged
            np.testing.assert_array_equal(after[j], before[j], err_msg=f"request {j} changed with request 1's seed")

        reprompted = list(base)
        reprompted[2] = {**base[2], "prompt": LONG_PROMPT}
        after = run(reprompted)
        # The tiny models see their prompts (see PROMPT_MOVES): a bug that mixed rows' text would move
        # images by far more than FLOAT_BOUND.
        changed = image_diff(after[2], before[2])
        assert changed > PROMPT_MOVES, f"a new prompt moved its image by only {changed:.3g}"
        if self.PADS_TEXT:
            # The longer prompt changes the others' padding, so they only hold the bound.
            others = [assert_close_images(after[j], before[j], to_uint8) for j in (0, 1, 3)]
            assert changed > 100 * max(others), (changed, others)
        else:
            for j in (0, 1, 3):  # fixed text length: the same shapes, bitwise unchanged
                np.testing.assert_array_equal(after[j], before[j], err_msg=f"request {j} changed with request 2's prompt")

    # -- previews ---------------------------------------------------------------------------

    def test_previews_have_the_image_size_and_never_change_the_result(self, adapter):
        plain = [Arrival(0, "a", self.params(steps=6, seed=1, num_images=2)),
                 Arrival(1, "b", self.params(PROMPTS[1], steps=5, seed=2))]
        with_previews = [Arrival(a.tick, a.request_id, {**a.params, "preview_interval": 2}) for a in plain]
        without = run_steps(adapter, plain)
        previewed = run_steps(adapter, with_previews)
        assert not without.previews
        assert [step for step, _ in previewed.previews["a"]] == [2, 4]
        assert [step for step, _ in previewed.previews["b"]] == [2, 4]
        for request_id, rows in (("a", 2), ("b", 1)):
            for _, preview in previewed.previews[request_id]:
                assert preview.dtype == np.uint8 and preview.shape == (rows, 64, 64, 3)
            np.testing.assert_array_equal(previewed.images[request_id], without.images[request_id])
        first, last = previewed.previews["a"][0][1], previewed.previews["a"][-1][1]
        assert not np.array_equal(first, last)  # the preview follows the latents

    # -- batched decode ---------------------------------------------------------------------

    def test_requests_finishing_together_decode_in_one_call(self, adapter, monkeypatch):
        calls: list[int] = []  # rows per vae.decode call
        original = adapter.pipe.vae.decode

        def counting_decode(latents, *args, **kwargs):
            calls.append(int(latents.shape[0]))
            return original(latents, *args, **kwargs)

        monkeypatch.setattr(adapter.pipe.vae, "decode", counting_decode)
        result = run_steps(adapter, self.staggered_arrivals(cfg=False))
        assert calls == [3, 1]  # r1, r2, r3 finish at tick 6 (one call), r0 at tick 7
        assert all(image.shape == (1, 64, 64, 3) for image in result.images.values())
        calls.clear()
        images = run_wave(adapter, [self.params(PROMPTS[i], steps=2, seed=i) for i in range(4)])
        assert calls == [4] and len(images) == 4

    # -- validation (the declaration, as the engine applies it at admission) -------------------

    def test_inputs_the_pipeline_does_not_declare_are_refused_by_name(self, adapter):
        declared = {s.name for s in adapter.input_specs() if not s.unused}
        candidates = {"negative_prompt": "x", "true_cfg_scale": 4.0, "guidance_scale": 2.0, "preview_interval": 1,
                      "max_sequence_length": 16, "num_frames": 9, "lora_name": "", "lora_scale": 0.5}
        for name, value in candidates.items():
            if name in declared:
                parse(adapter, {"prompt": "x", name: value})
            else:
                with pytest.raises(InvalidInputError) as info:
                    parse(adapter, {"prompt": "x", name: value})
                assert info.value.input_name == name and "does not use" in str(info.value)

    @pytest.mark.parametrize("bad, name", [
        (dict(num_inference_steps=0), "num_inference_steps"),
        (dict(height=60), "height"),
        (dict(width=0), "width"),
        (dict(num_images=0), "num_images"),
        (dict(max_sequence_length=0), "max_sequence_length"),
        (dict(max_sequence_length="above the pipeline's limit"), "max_sequence_length"),
    ])
    def test_validation_refuses_what_the_pipeline_cannot_run(self, adapter, bad, name):
        if bad.get("max_sequence_length") == "above the pipeline's limit":
            bad = dict(max_sequence_length=int(adapter.input_spec("max_sequence_length").high) + 1)
        with pytest.raises(InvalidInputError) as info:
            parse(adapter, {"prompt": "x", **bad})
        assert info.value.input_name == name


def step_batched_then_alone(adapter: PipelineAdapter, batched: list, alone: list, batched_ticks: int = 2,
                            ticks: int = 3) -> None:
    """Step `batched` with the adapter's batched Euler step for `batched_ticks` ticks, then per request, and
    `alone` per request throughout, on the same random predictions: a request that steps alone after batched
    steps (a ragged next tick, a failed batched step) must find its scheduler where those left it."""
    generator = torch.Generator().manual_seed(0)
    for tick in range(ticks):
        prediction = torch.randn(InputBatch.gather(alone)["latents"].shape, generator=generator)
        batch = InputBatch.gather(batched)
        if tick < batched_ticks:
            assert adapter.step_batch(batch, batched, prediction)
        else:
            for state, pred in zip(batched, batch.split(prediction)):
                adapter.step_scheduler(state, pred)
        for state, pred in zip(alone, InputBatch.gather(alone).split(prediction)):
            adapter.step_scheduler(state, pred)
