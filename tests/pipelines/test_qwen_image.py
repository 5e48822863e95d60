"""The Qwen-Image adapter against `QwenImagePipeline.__call__`, on the tiny random-weight pipeline (CPU, float32).

Solo runs (request mode and step mode) must be bitwise what diffusers gives;
batched runs may differ only by batch-size dependent CPU kernels (FLOAT_BOUND).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch

from engine_lib.config import EngineConfig
from engine_lib.pipelines.base import DiffusionRequestBatch
from engine_lib.pipelines.qwen_image import QwenImageAdapter, to_uint8
from engine_lib.pipelines.registry import load_adapter
from engine_lib.request import DiffusionRequest, InvalidInputError, SamplingParams
from parity_checks import FLOAT_BOUND, Arrival, assert_close_images, drive_steps, image_diff

NEGATIVE = "bad quality, blurry"
PROMPTS = ["a photo of a cat", "a red car", "an astronaut riding a horse on the moon", "a bowl of fruit"]


@pytest.fixture(scope="module")
def adapter(tiny_qwen_dir) -> QwenImageAdapter:
    """Loaded through the registry, as the engine loads it (cfg_batching on, the default)."""
    adapter = load_adapter(EngineConfig(model_path=str(tiny_qwen_dir), device="cpu", dtype="float32"))
    assert isinstance(adapter, QwenImageAdapter) and adapter.cfg_batching
    return adapter


@pytest.fixture(scope="module")
def sequential_cfg(adapter) -> QwenImageAdapter:
    """The same pipeline with cfg_batching off: cond and uncond as two forwards, as diffusers runs them."""
    return QwenImageAdapter(adapter.pipe, adapter.device, adapter.dtype, {"cfg_batching": False})


@pytest.fixture(scope="module")
def reference(adapter):
    """`QwenImagePipeline.__call__` for the same params: float32 [N, H, W, 3] in [0, 1] (memoised)."""

    @functools.lru_cache(maxsize=None)
    def run(p: SamplingParams) -> np.ndarray:
        images = adapter.pipe(
            p.prompt,
            negative_prompt=p.negative_prompt,
            true_cfg_scale=p.true_cfg_scale,
            height=p.height,
            width=p.width,
            num_inference_steps=p.num_inference_steps,
            num_images_per_prompt=p.num_images,
            generator=torch.Generator().manual_seed(p.seed),
            output_type="np",
        ).images
        images.setflags(write=False)
        return images

    return run


def params(prompt=PROMPTS[0], cfg=False, steps=4, seed=0, **kw) -> SamplingParams:
    cfg_kw = dict(negative_prompt=NEGATIVE, true_cfg_scale=4.0) if cfg else {}
    return SamplingParams(prompt=prompt, num_inference_steps=steps, seed=seed, height=64, width=64, **cfg_kw, **kw)


def forward_float(adapter, all_params: list[SamplingParams]) -> list[np.ndarray]:
    """forward()'s images before the uint8 rounding (forward = post_decode(denoise_requests(...)))."""
    batch = DiffusionRequestBatch([DiffusionRequest(f"r{i}", p) for i, p in enumerate(all_params)])
    return adapter.decode_float(adapter.denoise_requests(batch))


def solo_steps(adapter, p: SamplingParams, **kw):
    return drive_steps(adapter, [Arrival(0, "solo", p)], capacity=1, **kw).images["solo"]


# -- solo parity: bitwise -------------------------------------------------------------


@pytest.mark.parametrize("steps", [4, 7])
@pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "true-cfg"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_solo_matches_diffusers_bitwise(adapter, sequential_cfg, reference, seed, cfg, steps):
    """forward() and step mode, one request alone, give exactly `pipe(...)`'s image.

    With CFG, the bitwise path is cfg_batching=False (diffusers' two forwards of B rows);
    the batched 2B-row CFG forward is checked against the bound in the cfg_batching test.
    """
    p = params(cfg=cfg, steps=steps, seed=seed)
    runner = sequential_cfg if cfg else adapter
    expected = reference(p)
    batch = DiffusionRequestBatch([DiffusionRequest("solo", p)])
    [image] = runner.forward(batch)
    assert image.dtype == np.uint8 and image.shape == (1, 64, 64, 3)
    np.testing.assert_array_equal(image, to_uint8(expected))
    # post_decode is to_uint8(decode_float): equal floats give equal uint8 images.
    np.testing.assert_array_equal(solo_steps(runner, p, float_output=True), expected)


def test_solo_cfg_batching_within_bound(adapter, reference):
    """The default cfg_batching=True (one forward of 2B rows) stays within the bound of diffusers."""
    for seed in range(3):
        p = params(cfg=True, steps=4, seed=seed)
        diff = assert_close_images(forward_float(adapter, [p])[0], reference(p), to_uint8)
        print(f"solo cfg_batching seed {seed}: max abs diff {diff:.2e}")


def test_num_images_rows_match_diffusers(adapter, reference):
    p = params(steps=3, seed=5, num_images=2)
    [image] = adapter.forward(DiffusionRequestBatch([DiffusionRequest("two", p)]))
    assert image.shape == (2, 64, 64, 3)
    np.testing.assert_array_equal(image, to_uint8(reference(p)))


# -- batched parity: within the bound ------------------------------------------------


def staggered_arrivals(cfg: bool) -> list[Arrival]:
    """Step counts 8, 6, 5, 3 admitted at ticks 0, 1, 2, 4: four share ticks 4-6, three finish at tick 6."""
    plan = [(0, 8), (1, 6), (2, 5), (4, 3)]
    return [Arrival(tick, f"r{i}", params(PROMPTS[i], cfg=cfg, steps=steps, seed=10 + i))
            for i, (tick, steps) in enumerate(plan)]


@pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "true-cfg"])
def test_step_batch_staggered_matches_solo(adapter, reference, cfg):
    arrivals = staggered_arrivals(cfg)
    result = drive_steps(adapter, arrivals, capacity=4, float_output=True)
    assert max(result.batch_sizes) == 4, result.batch_sizes  # different steps and step counts in one forward
    assert result.finished_at == {"r0": 7, "r1": 6, "r2": 6, "r3": 6}
    diffs = [assert_close_images(result.images[a.request_id], reference(a.params), to_uint8) for a in arrivals]
    print(f"step batch cfg={cfg}: max abs diff per request {['%.2e' % d for d in diffs]}")


@pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "true-cfg"])
def test_fused_forward_matches_solo(adapter, reference, cfg):
    all_params = [params(PROMPTS[i], cfg=cfg, steps=4, seed=20 + i) for i in range(4)]
    images = forward_float(adapter, all_params)
    diffs = [assert_close_images(image, reference(p), to_uint8) for image, p in zip(images, all_params)]
    print(f"fused forward cfg={cfg}: max abs diff per request {['%.2e' % d for d in diffs]}")
    uint8 = adapter.forward(DiffusionRequestBatch([DiffusionRequest(f"r{i}", p) for i, p in enumerate(all_params)]))
    for image, expected in zip(uint8, images):
        np.testing.assert_array_equal(image, to_uint8(expected))


def test_cfg_batching_on_and_off_agree(adapter, sequential_cfg):
    arrivals = staggered_arrivals(cfg=True)
    batched = drive_steps(adapter, arrivals, float_output=True).images
    sequential = drive_steps(sequential_cfg, arrivals, float_output=True).images
    diffs = [assert_close_images(batched[k], sequential[k], to_uint8) for k in batched]
    print(f"cfg_batching on vs off: max abs diff {max(diffs):.2e}")


# -- isolation ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["fused", "steps"])
def test_changing_one_request_changes_only_its_image(adapter, mode):
    def run(all_params):
        if mode == "fused":
            return forward_float(adapter, all_params)
        result = drive_steps(adapter, [Arrival(i, f"r{i}", p) for i, p in enumerate(all_params)], float_output=True)
        return [result.images[f"r{i}"] for i in range(len(all_params))]

    base = [params(PROMPTS[i], steps=3 + i % 2, seed=30 + i) for i in range(4)]
    before = run(base)

    reseeded = list(base)
    reseeded[1] = params(PROMPTS[1], steps=base[1].num_inference_steps, seed=99)
    after = run(reseeded)
    assert image_diff(after[1], before[1]) > 1e-2
    for i in (0, 2, 3):  # same shapes, same kernels: the other rows are bitwise unchanged
        np.testing.assert_array_equal(after[i], before[i])

    reprompted = list(base)
    reprompted[2] = params("a small dog running in the green grass next to a river", steps=base[2].num_inference_steps,
                           seed=base[2].seed)
    after = run(reprompted)
    # A longer prompt changes the padding, so the others only hold the bound. (The tiny model's
    # random text encoder moves the image only ~5e-4, so compare against the others' change.)
    others = [assert_close_images(after[i], before[i], to_uint8) for i in (0, 1, 3)]
    changed = image_diff(after[2], before[2])
    assert changed > FLOAT_BOUND and changed > 100 * max(others), (changed, others)


# -- previews ---------------------------------------------------------------------------


def test_previews_have_the_image_size_and_never_change_the_result(adapter):
    plain = [Arrival(0, "a", params(steps=6, seed=1, num_images=2)), Arrival(1, "b", params(PROMPTS[1], steps=5, seed=2))]
    with_previews = [Arrival(a.tick, a.request_id, dataclasses.replace(a.params, preview_interval=2)) for a in plain]
    without = drive_steps(adapter, plain)
    previewed = drive_steps(adapter, with_previews)
    assert not without.previews
    assert [step for step, _ in previewed.previews["a"]] == [2, 4]
    assert [step for step, _ in previewed.previews["b"]] == [2, 4]
    for request_id, rows in (("a", 2), ("b", 1)):
        for _, preview in previewed.previews[request_id]:
            assert preview.dtype == np.uint8 and preview.shape == (rows, 64, 64, 3)
        np.testing.assert_array_equal(previewed.images[request_id], without.images[request_id])
    # The preview follows the latents: later previews differ from earlier ones.
    first, last = previewed.previews["a"][0][1], previewed.previews["a"][-1][1]
    assert not np.array_equal(first, last)


# -- batched decode ---------------------------------------------------------------------


@pytest.fixture
def decode_calls(adapter, monkeypatch):
    """Rows per `vae.decode` call."""
    calls: list[int] = []
    original = adapter.pipe.vae.decode

    def counting_decode(latents, *args, **kwargs):
        calls.append(int(latents.shape[0]))
        return original(latents, *args, **kwargs)

    monkeypatch.setattr(adapter.pipe.vae, "decode", counting_decode)
    return calls


def test_requests_finishing_together_decode_in_one_call(adapter, decode_calls):
    result = drive_steps(adapter, staggered_arrivals(cfg=False))
    assert decode_calls == [3, 1]  # r1, r2, r3 finish at tick 6 (one call), r0 at tick 7
    assert all(image.shape == (1, 64, 64, 3) for image in result.images.values())

    decode_calls.clear()
    images = adapter.forward(DiffusionRequestBatch([DiffusionRequest(f"r{i}", params(PROMPTS[i], steps=2, seed=i))
                                                    for i in range(4)]))
    assert decode_calls == [4] and len(images) == 4


# -- validation and registry -------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, name",
    [
        (dict(num_inference_steps=1), "num_inference_steps"),
        (dict(height=60), "height"),
        (dict(width=0), "width"),
        (dict(max_sequence_length=2048), "max_sequence_length"),
        (dict(lora_name="style"), "lora_name"),
        (dict(num_frames=9), "num_frames"),
    ],
)
def test_validate_rejects_what_the_pipeline_cannot_run(adapter, bad, name):
    with pytest.raises(InvalidInputError) as info:
        adapter.validate(SamplingParams(prompt="x", **bad))
    assert info.value.input_name == name
    if name == "num_inference_steps":
        assert "NaN" in str(info.value)


def test_adapter_limits_and_flags(adapter):
    adapter.validate(params(steps=2))
    assert adapter.size_multiple == adapter.pipe.vae_scale_factor * 2 == 8
    assert QwenImageAdapter.supports_request_batch and QwenImageAdapter.supports_step_execution
    assert QwenImageAdapter.supports_previews


def test_registry_resolves_names_devices_dtypes_and_paths(monkeypatch, tiny_qwen_dir):
    from engine_lib.pipelines import registry
    from engine_lib.request import ConfigError

    assert registry.get_adapter_class("qwen_image") is QwenImageAdapter
    with pytest.raises(ConfigError, match="qwen_image"):
        registry.get_adapter_class("nope")
    assert registry.resolve_device("cpu") == torch.device("cpu")
    assert registry.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert registry.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert registry.resolve_dtype("float16", torch.device("cpu")) == torch.float16
    monkeypatch.delenv(registry.MODEL_PATH_ENV, raising=False)
    assert registry.resolve_model_path(EngineConfig()) == str(tiny_qwen_dir)
    monkeypatch.setenv(registry.MODEL_PATH_ENV, "/elsewhere")
    assert registry.resolve_model_path(EngineConfig()) == "/elsewhere"
    assert registry.resolve_model_path(EngineConfig(model_path="/given")) == "/given"
