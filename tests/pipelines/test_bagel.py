"""BAGEL (our own model code) against golden data from the reference implementation.

tests/golden/bagel/ holds `golden.npz` from ByteDance-Seed/Bagel run in float32 on
the tiny weights (its README gives the procedure; the `tiny` preset `make models`
builds must be that checkpoint, bit for bit: `checkpoint.sha256` holds the hashes of
its weights, tokenizer and config). Every run here goes through the real loader and the adapter's step contract:
solo runs follow the golden latents step by step, batched requests (different
prompts, sizes, step counts, CFG on and off, joining at different steps) each equal
their own solo run.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_lib.config import EngineConfig
from engine_lib.pipelines import registry
from engine_lib.pipelines.bagel.adapter import BagelAdapter
from engine_lib.pipelines.bagel.pipeline import BagelPipeline
from engine_lib.request import InvalidInputError
from engine_lib.pipelines.tiny_models import ensure_model
from tests.helpers.parity_checks import load_tiny_adapter, parse, step_latents

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "bagel"
# The reference's cases (README): num_timesteps 6 = 5 updates, cfg_interval [0.4, 1], shift 3.
CASES = {
    "a": dict(prompt="a red cube on a blue floor", height=64, width=64, guidance_scale=4.0,
              cfg_renorm_type="global", seed=1),
    "b": dict(prompt="a green sphere next to a yellow cone", height=64, width=128, guidance_scale=4.0,
              cfg_renorm_type="channel", seed=2),
    "c": dict(prompt="a red cube on a blue floor", height=64, width=64, guidance_scale=1.0,
              cfg_renorm_type="global", seed=3),
}
COMMON = dict(num_inference_steps=5, cfg_img_scale=1.0, cfg_interval=(0.4, 1.0), cfg_renorm_min=0.0,
              timestep_shift=3.0)
LATENT_BOUND = 1e-5  # what an independent float32 implementation should reach (README); measured: 5e-7


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(GOLDEN / "golden.npz"))


@pytest.fixture(scope="module")
def adapter() -> BagelAdapter:
    return load_tiny_adapter("bagel", BagelAdapter)


def params(adapter, case: str, **changes):
    return parse(adapter, {**COMMON, **CASES[case], **changes})


def u8(image: np.ndarray) -> np.ndarray:
    return (np.clip(image, 0, 1) * 255).round().astype(np.uint8)


def test_the_tiny_preset_is_the_golden_checkpoint():
    built = ensure_model("bagel", "tiny")
    recorded = dict(line.split()[::-1] for line in (GOLDEN / "checkpoint.sha256").read_text().splitlines())
    assert {"ema.safetensors", "ae.safetensors", "tokenizer.json", "llm_config.json"} <= set(recorded)
    for name, digest in recorded.items():
        assert hashlib.sha256((built / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.parametrize("case", CASES)
def test_prompt_noise_and_schedule_are_the_references(adapter, golden, case):
    p = params(adapter, case)
    state = adapter.new_state("r", p)
    adapter.prepare_encode(state)
    assert adapter.pipe.token_ids(p.prompt) == golden[f"case_{case}_prompt_token_ids"].tolist()
    np.testing.assert_array_equal(state.latents.numpy(), golden[f"case_{case}_init_noise"])
    np.testing.assert_array_equal(state.timesteps.numpy(), golden[f"case_{case}_timesteps"])
    assert [adapter_scale(state, i) for i in range(5)] == golden[f"case_{case}_cfg_text_scale_used"].tolist()


def adapter_scale(state, step: int) -> float:
    state.step_index = step
    return state.guidance.cfg_text_scale if state.cfg_now() else 1.0


@pytest.mark.parametrize("case", CASES)
def test_solo_latents_follow_the_golden_run_and_the_image_is_within_one_level(adapter, golden, case):
    latents, images = step_latents(adapter, {"solo": (0, params(adapter, case))})
    diff = np.abs(latents["solo"] - golden[f"case_{case}_latents_after_step"]).max()
    assert diff <= LATENT_BOUND, diff
    levels = np.abs(u8(images["solo"][0]).astype(int) - golden[f"case_{case}_image_u8"].astype(int))
    assert levels.max() <= 1


def test_the_raw_velocity_is_the_references(adapter, golden):
    """One forward at golden step 2's input: the conditional and text-unconditional rows as llm2vae gives them."""
    p = params(adapter, "a")
    context = adapter.pipe.encode(p.prompt, p.height, p.width)
    x = torch.from_numpy(golden["case_a_latents_in"][2])
    rows = adapter.pipe.query_rows([context], [True])
    t = torch.tensor([golden["case_a_timesteps"][2]] * 2)
    raw = adapter.pipe.model.velocity(rows, torch.stack([x, x]), t)
    assert np.abs(raw[0].numpy() - golden["case_a_v_cond"][2]).max() <= LATENT_BOUND
    assert np.abs(raw[1].numpy() - golden["case_a_v_text_uncond"][2]).max() <= LATENT_BOUND


def test_batched_requests_joining_at_different_steps_equal_their_solo_runs(adapter):
    """The golden prompts together: two sizes, CFG global/channel/off, 5, 3 and 4 steps, joining at
    ticks 0, 1 and 2, so forwards hold 1, 2 and 3 requests with different cache lengths."""
    arrivals = {"a": (0, params(adapter, "a")), "b": (1, params(adapter, "b", num_inference_steps=3)),
                "c": (2, params(adapter, "c", num_inference_steps=4))}
    latents, images = step_latents(adapter, arrivals)
    for rid, (_, p) in arrivals.items():
        solo_latents, solo_images = step_latents(adapter, {rid: (0, p)})
        assert np.abs(latents[rid] - solo_latents[rid]).max() <= LATENT_BOUND, rid
        assert np.abs(u8(images[rid]).astype(int) - u8(solo_images[rid]).astype(int)).max() <= 1, rid


def test_a_renorm_over_the_whole_batch_would_be_caught(adapter):
    """The reference's packed 'global' renorm mixes requests; ours is per request. Two requests whose
    guided norms differ show it: batched equals solo for each."""
    arrivals = {"x": (0, params(adapter, "a")), "y": (0, params(adapter, "a", prompt="two red apples", seed=9,
                                                                 guidance_scale=7.0))}
    latents, _ = step_latents(adapter, arrivals)
    for rid, (_, p) in arrivals.items():
        assert np.abs(latents[rid] - step_latents(adapter, {rid: (0, p)})[0][rid]).max() <= LATENT_BOUND


@pytest.fixture
def rows_per_forward(adapter, monkeypatch) -> list[int]:
    """The rows (conditional plus unconditional) of each transformer forward, in order."""
    model, seen = adapter.pipe.model, []
    velocity = model.velocity
    monkeypatch.setattr(model, "velocity", lambda rows, latents, t, *groups: seen.append(len(t)) or velocity(
        rows, latents, t, *groups))
    return seen


def test_cfg_runs_only_inside_the_interval_and_the_edges_change_nothing_else(adapter, rows_per_forward):
    """cfg_interval (0.5, 0.9) on the timesteps 1, 0.92, 0.82, 0.67, 0.43: CFG at the middle two steps only.
    Above the interval the latents are the unguided run's; below it the update is the conditional velocity
    alone; batched with a request that keeps CFG on throughout, each equals its solo run."""
    p = params(adapter, "a", cfg_interval=(0.5, 0.9))
    solo, _ = step_latents(adapter, {"r": (0, p)})
    assert rows_per_forward == [1, 1, 2, 2, 1]
    unguided, _ = step_latents(adapter, {"r": (0, params(adapter, "a", guidance_scale=1.0))})
    np.testing.assert_array_equal(solo["r"][:2], unguided["r"][:2])
    assert np.abs(solo["r"][2] - unguided["r"][2]).max() > 1e-3, "CFG moves the first step inside the interval"
    state = adapter.new_state("r", p)
    adapter.prepare_encode(state)
    x = torch.from_numpy(solo["r"][3])
    [v] = adapter.pipe.model.velocity(adapter.pipe.query_rows([state.context], [False]), x[None],
                                      state.timesteps[4:5])
    assert np.abs(solo["r"][4] - (x - v * state.dts[4]).numpy()).max() <= LATENT_BOUND
    del rows_per_forward[:]
    arrivals = {"edges": (0, p), "always": (0, params(adapter, "b"))}
    latents, _ = step_latents(adapter, arrivals)
    assert rows_per_forward == [3, 3, 4, 4, 3]
    assert np.abs(latents["edges"] - solo["r"]).max() <= LATENT_BOUND
    assert np.abs(latents["always"] - step_latents(adapter, {"b": (0, arrivals["always"][1])})[0]["b"]).max() \
        <= LATENT_BOUND


def test_guidance_one_runs_no_unconditional_rows(adapter, rows_per_forward):
    """At guidance 1 CFG changes nothing but its cost: one row per step, and the cost of one row."""
    p = params(adapter, "c")  # guidance 1, the interval covers every step
    step_latents(adapter, {"r": (0, p)})
    assert rows_per_forward == [1] * 5
    assert adapter.request_cost(p) * 2 == adapter.request_cost(params(adapter, "a"))


def test_a_request_without_cfg_ahead_of_one_with_cfg_in_one_forward(adapter, rows_per_forward):
    """The unconditional rows follow every conditional row: the CFG request's is the last row, not the
    second, whatever the order of the requests in the batch (here the one without CFG comes first)."""
    arrivals = {"plain": (0, params(adapter, "c")), "guided": (0, params(adapter, "b", num_inference_steps=3))}
    latents, images = step_latents(adapter, arrivals)
    assert rows_per_forward[:3] == [3, 3, 3]
    for rid, (_, p) in arrivals.items():
        solo_latents, solo_images = step_latents(adapter, {rid: (0, p)})
        assert np.abs(latents[rid] - solo_latents[rid]).max() <= LATENT_BOUND, rid
        assert np.abs(u8(images[rid]).astype(int) - u8(solo_images[rid]).astype(int)).max() <= 1, rid


def test_k_steps_make_exactly_k_updates(adapter):
    for k in (1, 2):
        latents, images = step_latents(adapter, {"r": (0, params(adapter, "a", num_inference_steps=k))})
        assert latents["r"].shape[0] == k and images["r"].shape == (1, 64, 64, 3)


@pytest.mark.parametrize("inputs, name, says", [
    ({"cfg_interval": (0.9, 0.2)}, "cfg_interval", "after end"),
    ({"cfg_interval": (0.4,)}, "cfg_interval", "must be 2 values"),
    ({"cfg_interval": (0.4, 1.5)}, "cfg_interval", "[0, 1]"),
    ({"cfg_renorm_type": "per_token"}, "cfg_renorm_type", "global, channel, text_channel"),
    ({"height": 72}, "height", "multiple of 16"),
    ({"width": 272}, "width", "[16, 256]"),  # the tiny position table: 16 patches of 16 px
    ({"negative_prompt": "x"}, "negative_prompt", "does not use this input"),
])
def test_bad_inputs_name_the_input(adapter, inputs, name, says):
    with pytest.raises(InvalidInputError) as caught:
        adapter.input_schema(EngineConfig()).parse({"prompt": "a cat", **inputs})
    assert caught.value.input_name == name and says in str(caught.value)


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    folder = tmp_path / "bagel"
    shutil.copytree(ensure_model("bagel", "tiny"), folder)
    return folder


@pytest.mark.parametrize("file, change, says", [
    ("ema.safetensors", "drop:llm2vae.bias", "missing key 'llm2vae.bias'"),
    ("ema.safetensors", "add:language_model.model.layers.0.extra.weight",
     "unexpected key 'language_model.model.layers.0.extra.weight'"),
    ("ae.safetensors", "drop:decoder.mid.attn_1.q.bias", "missing key 'decoder.mid.attn_1.q.bias'"),
    ("ae.safetensors", "add:decoder.up.9.block.0.conv1.weight", "unexpected key 'decoder.up.9.block.0.conv1.weight'"),
])
def test_a_missing_or_extra_key_fails_the_load_naming_it(checkpoint, file, change, says):
    state = load_file(str(checkpoint / file))
    action, key = change.split(":")
    if action == "drop":
        del state[key]
    else:
        state[key] = torch.zeros(2)
    save_file(state, str(checkpoint / file))
    with pytest.raises(ValueError, match=f"{file}: {says}"):
        BagelPipeline.from_pretrained(str(checkpoint))


def test_understanding_weights_are_skipped_with_one_log_line(checkpoint, caplog):
    state = load_file(str(checkpoint / "ema.safetensors"))
    state["vit_model.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4)
    state["connector.fc1.weight"] = torch.zeros(4)
    save_file(state, str(checkpoint / "ema.safetensors"))
    with caplog.at_level(logging.INFO, logger="engine_lib.pipelines.bagel.model"):
        BagelPipeline.from_pretrained(str(checkpoint))
    lines = [r.getMessage() for r in caplog.records if "understanding-only" in r.getMessage()]
    assert lines == ["skipped 2 understanding-only tensors (connector, vit_model)"]  # lm_head is loaded: it answers


def test_the_registry_loads_it_in_step_mode_only():
    cls = registry.get_adapter_class("bagel")
    runs = cls.capabilities.supports
    assert runs("step_execution") and not runs("request_batch") and not runs("previews")
