"""Shared parity checks for pipeline adapters: a minimal step driver, image comparisons,
and `FlowMatchParitySuite`, the parity tests every flow-matching adapter runs.

The driver is what the engine's runner does each tick, and nothing more: admit
arrivals up to a capacity (`prepare_encode`), gather one InputBatch, one
`denoise_step`, split, `step_scheduler` per request, previews, and one
`post_decode` for the requests that finished in the same tick.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import numpy as np
import pytest
import torch

from engine_lib.config import EngineConfig
from engine_lib.pipelines.base import DiffusionRequestBatch, InputBatch, PipelineAdapter, StepRequestState
from engine_lib.pipelines.flow_match import to_uint8
from engine_lib.request import DiffusionRequest, InvalidInputError, SamplingParams

# Batch-size dependent CPU float32 kernels move pixels by about 1e-6 (measured; see
# docs/pipelines.md); this bound is two orders of magnitude above that.
FLOAT_BOUND = 1e-4
MAX_UINT8_CHANGED_FRACTION = 0.001  # pixels allowed to differ, by at most 1 level


def load_tiny_adapter(pipeline: str, adapter_cls: type) -> PipelineAdapter:
    """The tiny model of `pipeline`, loaded through the registry as the engine loads it (CPU, float32)."""
    from engine_lib.pipelines.registry import load_adapter
    from engine_lib.tiny_models import ensure_model

    model_dir = ensure_model(pipeline, "tiny")
    adapter = load_adapter(EngineConfig(pipeline=pipeline, model_path=str(model_dir), device="cpu", dtype="float32"))
    assert isinstance(adapter, adapter_cls) and adapter.cfg_batching  # cfg_batching on is the default
    return adapter


def with_cfg_batching(adapter: PipelineAdapter, on: bool) -> PipelineAdapter:
    """The same pipe and options with cfg_batching `on` (off: cond and uncond as two forwards of B rows)."""
    return type(adapter)(adapter.pipe, adapter.device, adapter.dtype, {**adapter.options, "cfg_batching": on})


@dataclass(frozen=True)
class Arrival:
    tick: int
    request_id: str
    params: SamplingParams


@dataclass
class DriveResult:
    images: dict[str, np.ndarray] = field(default_factory=dict)  # uint8, or float32 with float_output
    previews: dict[str, list[tuple[int, np.ndarray]]] = field(default_factory=dict)  # (step, preview)
    batch_sizes: list[int] = field(default_factory=list)  # requests in each tick's forward
    finished_at: dict[str, int] = field(default_factory=dict)  # request id -> tick


def drive_steps(adapter: PipelineAdapter, arrivals: list[Arrival], capacity: int = 4,
                float_output: bool = False) -> DriveResult:
    """Run arrivals through the step contract tick by tick; previews follow each request's preview_interval."""
    pending = sorted(arrivals, key=lambda a: a.tick)
    running: list[StepRequestState] = []
    input_batch: Optional[InputBatch] = None
    result = DriveResult()
    tick = 0
    while pending or running:
        while pending and pending[0].tick <= tick and len(running) < capacity:
            arrival = pending.pop(0)
            state = StepRequestState(arrival.request_id, arrival.params)
            adapter.prepare_encode(state)
            running.append(state)
        if running:
            input_batch = InputBatch.gather(running, previous=input_batch)
            result.batch_sizes.append(len(running))
            noise_pred = adapter.denoise_step(input_batch, states=running)
            for state, rows in zip(running, input_batch.split(noise_pred)):
                adapter.step_scheduler(state, rows)
            for state in running:
                k = state.params.preview_interval
                if k and not state.denoise_completed and state.step_index % k == 0:
                    result.previews.setdefault(state.request_id, []).append((state.step_index, adapter.preview(state)))
            done = [s for s in running if s.denoise_completed]
            if done:
                decode = adapter.decode_float if float_output else adapter.post_decode
                for state, images in zip(done, decode(done)):
                    result.images[state.request_id] = images
                    result.finished_at[state.request_id] = tick
                running = [s for s in running if not s.denoise_completed]
        tick += 1
    return result


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
    levels = np.abs(to_uint8(actual).astype(np.int16) - to_uint8(expected).astype(np.int16))
    assert levels.max() <= 1, f"uint8 images differ by {levels.max()} levels"
    changed = float((levels > 0).mean())
    assert changed <= MAX_UINT8_CHANGED_FRACTION, f"{changed:.3%} of uint8 values differ"
    return diff


# -- the shared parity suite ---------------------------------------------------------------

PROMPTS = ["a photo of a cat", "a red car", "an astronaut riding a horse on the moon", "a bowl of fruit"]
LONG_PROMPT = "a small dog running in the green grass next to a river"


def make_reference(adapter: PipelineAdapter, pipe_inputs: tuple[str, ...]):
    """`pipe(...)` for SamplingParams: float32 [N, H, W, 3] in [0, 1], memoised (read-only arrays).

    `pipe_inputs` name the SamplingParams fields that are `pipe(...)` arguments of the
    same name; each is passed when set (None leaves diffusers' default).
    """

    @functools.lru_cache(maxsize=None)
    def run(p: SamplingParams) -> np.ndarray:
        kwargs = {name: getattr(p, name) for name in pipe_inputs if getattr(p, name) is not None}
        images = adapter.pipe(
            p.prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
            num_images_per_prompt=p.num_images, generator=torch.Generator().manual_seed(p.seed),
            output_type="np", **kwargs,
        ).images
        images.setflags(write=False)
        return images

    return run


def forward_float(adapter, all_params: list[SamplingParams]) -> list[np.ndarray]:
    """forward()'s images before the uint8 rounding (forward = post_decode(denoise_requests(...)))."""
    batch = DiffusionRequestBatch([DiffusionRequest(f"r{i}", p) for i, p in enumerate(all_params)])
    return adapter.decode_float(adapter.denoise_requests(batch))


def solo_steps(adapter, p: SamplingParams, **kw):
    return drive_steps(adapter, [Arrival(0, "solo", p)], capacity=1, **kw).images["solo"]


class FlowMatchParitySuite:
    """The parity tests every FlowMatchAdapter runs against its own diffusers pipeline.

    Solo runs (request mode and step mode) must be bitwise what `pipe(...)` gives;
    batched runs may differ only by batch-size dependent CPU kernels (FLOAT_BOUND
    and the uint8 rule of `assert_close_images`).

    A test module subclasses it (as `Test<Pipeline>Parity`) and provides module
    fixtures: `adapter` (`load_tiny_adapter`: through the registry, cfg_batching
    on), `bitwise_adapter` (the cfg_batching setting that is diffusers' own CFG
    execution) and `reference` (`make_reference`). Class attributes say how params
    look with and without CFG, and where pipelines differ.
    """

    BASE: ClassVar[dict] = {}  # added to every request's params (e.g. a short max_sequence_length)
    NO_CFG: ClassVar[dict] = {}
    CFG: ClassVar[dict] = {}
    SEEDS: ClassVar[tuple] = (0, 1, 2)
    STEPS: ClassVar[tuple] = (3, 5)  # solo step counts; the first also runs the solo cfg_batching check
    # True where prompts of different lengths share a forward padded to the longest (the
    # transformer takes a mask): a longer prompt then changes the other rows' padding.
    PADS_TEXT: ClassVar[bool] = False
    # Inputs in `supported_inputs` that the tiny checkpoint rejects as unused (e.g. guidance
    # without guidance embeddings).
    CHECKPOINT_REJECTS: ClassVar[frozenset] = frozenset()

    @classmethod
    def params(cls, prompt: str = PROMPTS[0], cfg: bool = False, steps: int = 4, seed: int = 0,
               **kw: Any) -> SamplingParams:
        fields = {"height": 64, "width": 64, **cls.BASE, **(cls.CFG if cfg else cls.NO_CFG), **kw}
        return SamplingParams(prompt=prompt, num_inference_steps=steps, seed=seed, **fields)

    @classmethod
    def staggered_arrivals(cls, cfg: bool) -> list[Arrival]:
        """Step counts 8, 6, 5, 3 admitted at ticks 0, 1, 2, 4: four share ticks 4-6, three finish at tick 6."""
        plan = [(0, 8), (1, 6), (2, 5), (4, 3)]
        return [Arrival(tick, f"r{i}", cls.params(PROMPTS[i], cfg=cfg, steps=steps, seed=10 + i))
                for i, (tick, steps) in enumerate(plan)]

    # -- solo parity: bitwise ---------------------------------------------------------

    @pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "cfg"])
    def test_solo_matches_diffusers_bitwise(self, adapter, bitwise_adapter, reference, cfg):
        """forward() and step mode, one request alone, give exactly `pipe(...)`'s image (SEEDS x STEPS).

        Without CFG this is the engine's default adapter (cfg_batching does not apply); with CFG it
        is `bitwise_adapter`, and the other CFG execution is checked in the cfg_batching test.
        """
        runner = bitwise_adapter if cfg else adapter
        for seed in self.SEEDS:
            for steps in self.STEPS:
                p = self.params(cfg=cfg, steps=steps, seed=seed)
                expected = reference(p)
                [image] = runner.forward(DiffusionRequestBatch([DiffusionRequest("solo", p)]))
                assert image.dtype == np.uint8 and image.shape == (1, 64, 64, 3)
                np.testing.assert_array_equal(image, to_uint8(expected), err_msg=f"forward, seed {seed}, {steps} steps")
                # post_decode is to_uint8(decode_float): equal floats give equal uint8 images.
                np.testing.assert_array_equal(solo_steps(runner, p, float_output=True), expected,
                                              err_msg=f"steps, seed {seed}, {steps} steps")

    def test_solo_at_the_default_text_length_and_several_images(self, adapter, reference):
        p = dataclasses.replace(self.params(steps=3, seed=5, num_images=2), max_sequence_length=None)
        [image] = adapter.forward(DiffusionRequestBatch([DiffusionRequest("two", p)]))
        assert image.shape == (2, 64, 64, 3)
        np.testing.assert_array_equal(image, to_uint8(reference(p)))

    def test_cfg_batching_on_and_off_agree(self, adapter, reference):
        """Both CFG executions (one forward of 2B rows, two of B rows) stay within the bound of each other
        in a staggered step batch, and of diffusers solo (SEEDS at the first of STEPS)."""
        other = with_cfg_batching(adapter, not adapter.cfg_batching)
        arrivals = self.staggered_arrivals(cfg=True)
        one = drive_steps(adapter, arrivals, float_output=True).images
        two = drive_steps(other, arrivals, float_output=True).images
        diffs = [assert_close_images(one[a.request_id], two[a.request_id], to_uint8) for a in arrivals]
        for seed in self.SEEDS:
            p = self.params(cfg=True, steps=self.STEPS[0], seed=seed)
            for runner in (adapter, other):
                diffs.append(assert_close_images(forward_float(runner, [p])[0], reference(p), to_uint8))
        print(f"{adapter.name} cfg_batching on vs off, and each vs diffusers: max abs diff {max(diffs):.2e}")

    # -- batched parity: within the bound ---------------------------------------------

    @pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "cfg"])
    def test_step_batch_staggered_matches_solo(self, adapter, reference, cfg):
        arrivals = self.staggered_arrivals(cfg)
        result = drive_steps(adapter, arrivals, capacity=4, float_output=True)
        assert max(result.batch_sizes) == 4, result.batch_sizes  # different steps and step counts in one forward
        assert result.finished_at == {"r0": 7, "r1": 6, "r2": 6, "r3": 6}
        diffs = [assert_close_images(result.images[a.request_id], reference(a.params), to_uint8) for a in arrivals]
        print(f"{adapter.name} step batch cfg={cfg}: max abs diff per request {['%.2e' % d for d in diffs]}")

    @pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "cfg"])
    def test_fused_forward_matches_solo(self, adapter, reference, cfg):
        all_params = [self.params(PROMPTS[i], cfg=cfg, steps=4, seed=20 + i) for i in range(4)]
        images = forward_float(adapter, all_params)
        diffs = [assert_close_images(image, reference(p), to_uint8) for image, p in zip(images, all_params)]
        print(f"{adapter.name} fused forward cfg={cfg}: max abs diff per request {['%.2e' % d for d in diffs]}")
        uint8 = adapter.forward(DiffusionRequestBatch([DiffusionRequest(f"r{i}", p) for i, p in enumerate(all_params)]))
        for image, expected in zip(uint8, images):
            np.testing.assert_array_equal(image, to_uint8(expected))

    # -- isolation ------------------------------------------------------------------------

    @pytest.mark.parametrize("mode", ["fused", "steps"])
    def test_changing_one_request_changes_only_its_image(self, adapter, mode):
        def run(all_params):
            if mode == "fused":
                return forward_float(adapter, all_params)
            arrivals = [Arrival(i, f"r{i}", p) for i, p in enumerate(all_params)]
            result = drive_steps(adapter, arrivals, float_output=True)
            return [result.images[f"r{i}"] for i in range(len(all_params))]

        # Step counts 3 and 4 in both modes: a fused forward drops requests as they finish, as a step batch does.
        base = [self.params(PROMPTS[i], steps=3 + i % 2, seed=30 + i) for i in range(4)]
        before = run(base)

        reseeded = list(base)
        reseeded[1] = dataclasses.replace(base[1], seed=99)
        after = run(reseeded)
        assert image_diff(after[1], before[1]) > 1e-2, "a new seed did not change its image"
        for j in (0, 2, 3):  # same shapes, same kernels: bitwise unchanged
            np.testing.assert_array_equal(after[j], before[j], err_msg=f"request {j} changed with request 1's seed")

        reprompted = list(base)
        reprompted[2] = dataclasses.replace(base[2], prompt=LONG_PROMPT)
        after = run(reprompted)
        changed = image_diff(after[2], before[2])
        if self.PADS_TEXT:
            # The longer prompt changes the others' padding, so they only hold the bound. (A tiny random
            # text encoder moves the image little, ~5e-4 for Qwen-Image: compare with the others' change.)
            others = [assert_close_images(after[j], before[j], to_uint8) for j in (0, 1, 3)]
            assert changed > FLOAT_BOUND and changed > 100 * max(others), (changed, others)
        else:
            assert changed > 1e-3, "a new prompt did not change its image"
            for j in (0, 1, 3):  # fixed text length: the same shapes, bitwise unchanged
                np.testing.assert_array_equal(after[j], before[j], err_msg=f"request {j} changed with request 2's prompt")

    # -- previews ---------------------------------------------------------------------------

    def test_previews_have_the_image_size_and_never_change_the_result(self, adapter):
        plain = [Arrival(0, "a", self.params(steps=6, seed=1, num_images=2)),
                 Arrival(1, "b", self.params(PROMPTS[1], steps=5, seed=2))]
        with_previews = [Arrival(a.tick, a.request_id, dataclasses.replace(a.params, preview_interval=2))
                         for a in plain]
        without = drive_steps(adapter, plain)
        previewed = drive_steps(adapter, with_previews)
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
        result = drive_steps(adapter, self.staggered_arrivals(cfg=False))
        assert calls == [3, 1]  # r1, r2, r3 finish at tick 6 (one call), r0 at tick 7
        assert all(image.shape == (1, 64, 64, 3) for image in result.images.values())
        calls.clear()
        requests = [DiffusionRequest(f"r{i}", self.params(PROMPTS[i], steps=2, seed=i)) for i in range(4)]
        images = adapter.forward(DiffusionRequestBatch(requests))
        assert calls == [4] and len(images) == 4

    # -- validation -------------------------------------------------------------------------

    def test_validate_rejects_inputs_the_pipeline_does_not_use(self, adapter):
        unused = {"negative_prompt": "x", "true_cfg_scale": 4.0, "guidance_scale": 2.0, "preview_interval": 1,
                  "max_sequence_length": 16, "num_frames": 9, "lora_name": "style", "lora_scale": 0.5}
        for name, value in unused.items():
            p = SamplingParams(prompt="x", **{name: value})
            if name in adapter.supported_inputs and name not in self.CHECKPOINT_REJECTS:
                adapter.validate(p)
            else:
                with pytest.raises(InvalidInputError) as info:
                    adapter.validate(p)
                assert info.value.input_name == name and "does not use" in str(info.value)

    @pytest.mark.parametrize("bad, name", [
        (dict(num_inference_steps=0), "num_inference_steps"),
        (dict(height=60), "height"),
        (dict(width=0), "width"),
        (dict(num_images=0), "num_images"),
        (dict(max_sequence_length=0), "max_sequence_length"),
        (dict(max_sequence_length="above the pipeline's limit"), "max_sequence_length"),
    ])
    def test_validate_rejects_what_the_pipeline_cannot_run(self, adapter, bad, name):
        if bad.get("max_sequence_length") == "above the pipeline's limit":
            bad = dict(max_sequence_length=adapter.max_max_sequence_length + 1)
        with pytest.raises(InvalidInputError) as info:
            adapter.validate(SamplingParams(prompt="x", **bad))
        assert info.value.input_name == name
