"""HunyuanImage-3.0 (our own model code) against golden data from the reference implementation.

tests/golden/hunyuan_image3/ holds `golden.npz` from Tencent-Hunyuan/HunyuanImage-3.0 run
in float32 on the tiny weights (its README gives the procedure; the `tiny` preset
`make models` builds must be that checkpoint: `checkpoint.sha256` holds the hashes of
its weights, config and tokenizer files).
Every run goes through the real loader and the adapter's step contract.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_lib.config import EngineConfig
from engine_lib.pipelines.hunyuan_image3.adapter import HunyuanImage3Adapter
from engine_lib.pipelines.hunyuan_image3.model import image_positions, rope_2d, text_positions
from engine_lib.pipelines.hunyuan_image3.pipeline import HunyuanImage3Pipeline
from engine_lib.request import InvalidInputError
from engine_lib.pipelines.tiny_models import ensure_model
from tests.helpers.parity_checks import load_tiny_adapter, parse, step_latents

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "hunyuan_image3"
# The reference's cases (README): 4 steps, flow_shift 3.
CASES = {
    "a": dict(prompt="a red cube on a blue floor", height=64, width=64, guidance_scale=5.0, seed=1),
    "b": dict(prompt="a green sphere next to a yellow cone", height=48, width=80, guidance_scale=3.5, seed=2),
}
LATENT_BOUND = 1e-5  # what an independent float32 implementation should reach; measured: 1.2e-6


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(GOLDEN / "golden.npz"))


@pytest.fixture(scope="module")
def adapter() -> HunyuanImage3Adapter:
    return load_tiny_adapter("hunyuan_image3", HunyuanImage3Adapter)


def params(adapter, case: str, **changes):
    return parse(adapter, {"num_inference_steps": 4, "flow_shift": 3.0, **CASES[case], **changes})


def u8(image: np.ndarray) -> np.ndarray:
    return (np.clip(image, 0, 1) * 255).round().astype(np.uint8)


def test_the_tiny_preset_is_the_golden_checkpoint():
    built = ensure_model("hunyuan_image3", "tiny")
    recorded = dict(line.split()[::-1] for line in (GOLDEN / "checkpoint.sha256").read_text().splitlines())
    assert {"model.safetensors", "config.json", "tokenizer/tokenizer.json"} <= set(recorded)
    for name, digest in recorded.items():
        assert hashlib.sha256((built / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.parametrize("case", CASES)
def test_sequence_positions_noise_and_schedule_are_the_references(adapter, golden, case):
    p = params(adapter, case)
    pipe = adapter.pipe
    ids = golden[f"case_{case}_input_ids"]
    prefix = pipe.prefix_ids(p.prompt, p.height, p.width)
    assert prefix == ids[0, :len(prefix)].tolist()
    assert pipe.prefix_ids(p.prompt, p.height, p.width, uncond=True) == ids[1, :len(prefix)].tolist()
    # the rest of the reference's sequence: <timestep>, the image tokens, <eoi>
    h, w = p.height // 16, p.width // 16
    assert ids[0, len(prefix):].tolist() == [341] + [339] * (h * w) + [338]
    start, n = len(prefix), h * w
    positions = torch.cat([text_positions(0, start + 1), image_positions(start + 1, (h, w)),
                           text_positions(start + 1 + n, start + 2 + n)])
    cos, sin = rope_2d(positions, 16, 10000.0)
    np.testing.assert_array_equal(cos.numpy(), golden[f"case_{case}_rope_cos"][0])
    np.testing.assert_array_equal(sin.numpy(), golden[f"case_{case}_rope_sin"][0])
    state = adapter.new_state("r", p)
    adapter.prepare_encode(state)
    np.testing.assert_array_equal(state.latents.numpy(), golden[f"case_{case}_init_noise"][0])
    np.testing.assert_array_equal(state.sigmas.numpy(), golden[f"case_{case}_sigmas"])


@pytest.mark.parametrize("case", CASES)
def test_raw_predictions_are_the_references(adapter, golden, case):
    """Each step's conditional and unconditional predictions at the golden step input, in one forward."""
    p = params(adapter, case)
    context = adapter.pipe.encode(p.prompt, p.height, p.width, cfg=True)
    sigmas = adapter.pipe.sigmas(4, 3.0)
    for i in range(4):
        x = torch.from_numpy(golden[f"case_{case}_latents_in"][i])
        rows = adapter.pipe.model.image_rows([context.cond, context.uncond], [context.grid] * 2)
        cond, uncond = adapter.pipe.model.predict(rows, [x, x], torch.stack([sigmas[i]] * 2) * 1000)
        assert np.abs(cond.numpy() - golden[f"case_{case}_pred_cond"][i]).max() <= LATENT_BOUND
        assert np.abs(uncond.numpy() - golden[f"case_{case}_pred_uncond"][i]).max() <= LATENT_BOUND


@pytest.mark.parametrize("case", CASES)
def test_solo_latents_follow_the_golden_run_and_the_image_is_within_one_level(adapter, golden, case):
    latents, images = step_latents(adapter, {"solo": (0, params(adapter, case))})
    diff = np.abs(latents["solo"] - golden[f"case_{case}_latents_after_step"]).max()
    assert diff <= LATENT_BOUND, diff
    assert np.abs(u8(images["solo"][0]).astype(int) - golden[f"case_{case}_image_u8"].astype(int)).max() <= 1


def test_batched_requests_joining_at_different_steps_equal_their_solo_runs(adapter):
    """The golden cases together, plus a request without CFG: two sizes, prompts of different lengths,
    4, 3 and 2 steps, joining at ticks 0, 1 and 2."""
    arrivals = {"a": (0, params(adapter, "a")), "b": (1, params(adapter, "b", num_inference_steps=3)),
                "c": (2, params(adapter, "a", prompt="a cat", guidance_scale=1.0, num_inference_steps=2, seed=5))}
    latents, images = step_latents(adapter, arrivals)
    for rid, (_, p) in arrivals.items():
        solo_latents, solo_images = step_latents(adapter, {rid: (0, p)})
        assert np.abs(latents[rid] - solo_latents[rid]).max() <= LATENT_BOUND, rid
        assert np.abs(u8(images[rid]).astype(int) - u8(solo_images[rid]).astype(int)).max() <= 1, rid


def test_guidance_at_most_one_runs_the_conditional_pass_alone(adapter, golden):
    """The reference crashes here; ours runs one row: the conditional prediction, unguided."""
    p = params(adapter, "a", guidance_scale=1.0)
    state = adapter.new_state("r", p)
    adapter.prepare_encode(state)
    assert state.context.uncond is None
    latents, images = step_latents(adapter, {"r": (0, p)})
    x = torch.from_numpy(golden["case_a_init_noise"][0])
    sigmas = adapter.pipe.sigmas(4, 3.0)
    rows = adapter.pipe.model.image_rows([state.context.cond], [state.context.grid])
    [cond] = adapter.pipe.model.predict(rows, [x], sigmas[:1] * 1000)
    np.testing.assert_allclose(latents["r"][0], (x + cond * (sigmas[1] - sigmas[0])).numpy(), atol=1e-6)
    assert images["r"].shape == (1, 64, 64, 3)


@pytest.mark.parametrize("inputs, name, says", [
    ({"height": 64, "width": 32}, "height", "not one of this model's sizes"),
    ({"height": 72}, "height", "multiple of 16"),
    ({"width": 144}, "width", "[16, 128]"),
    ({"flow_shift": 0}, "flow_shift", "[0.01, 100]"),
    ({"negative_prompt": "x"}, "negative_prompt", "does not use this input"),
])
def test_bad_inputs_name_the_input(adapter, inputs, name, says):
    with pytest.raises(InvalidInputError) as caught:
        adapter.input_schema(EngineConfig()).parse({"prompt": "a cat", **inputs})
    assert caught.value.input_name == name and says in str(caught.value)


def test_defaults_come_from_the_model_folders_generation_config(tmp_path):
    folder = tmp_path / "hy3"
    shutil.copytree(ensure_model("hunyuan_image3", "tiny"), folder)
    (folder / "generation_config.json").write_text('{"diff_infer_steps": 7, "diff_guidance_scale": 2.5}')
    adapter = HunyuanImage3Adapter.load(str(folder), torch.device("cpu"), torch.float32)
    p = adapter.input_schema(EngineConfig()).parse({"prompt": "a cat"})
    assert (p.num_inference_steps, p.guidance_scale, p.flow_shift) == (7, 2.5, 3.0)


@pytest.mark.parametrize("change, says", [
    ("drop:model.layers.1.mlp.experts.3.down_proj.weight", "missing key 'model.layers.1.mlp.experts.3.down_proj.weight'"),
    ("drop:vae.decoder.up.0.upsample.conv.bias", "missing key 'vae.decoder.up.0.upsample.conv.bias'"),
    ("add:model.layers.0.mlp.experts.9.down_proj.weight", "unexpected key 'model.layers.0.mlp.experts.9.down_proj.weight'"),
])
def test_a_missing_or_extra_key_fails_the_load_naming_it(tmp_path, change, says):
    folder = tmp_path / "hy3"
    shutil.copytree(ensure_model("hunyuan_image3", "tiny"), folder)
    state = load_file(str(folder / "model.safetensors"))
    action, key = change.split(":")
    if action == "drop":
        del state[key]
    else:
        state[key] = torch.zeros(2)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=f"model weights: {says}"):
        HunyuanImage3Pipeline.from_pretrained(str(folder))


def test_shards_are_read_through_the_index_and_understanding_parts_skipped(tmp_path, caplog):
    folder = tmp_path / "hy3"
    shutil.copytree(ensure_model("hunyuan_image3", "tiny"), folder)
    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, part in shards.items():
        save_file({k: state[k] for k in part}, str(folder / name))
    (folder / "model.safetensors.index.json").write_text(
        '{"weight_map": {' + ", ".join(f'"{k}": "{n}"' for n, part in shards.items() for k in part) + "}}")
    with caplog.at_level(logging.INFO, logger="engine_lib.pipelines.hunyuan_image3.model"):
        pipe = HunyuanImage3Pipeline.from_pretrained(str(folder))
    assert [r.getMessage() for r in caplog.records if "understanding-only" in r.getMessage()] == [
        "skipped 107 understanding-only tensors (lm_head, model.ln_f, vae.encoder, vision_aligner, vision_model)"]
    assert torch.equal(pipe.model.model.wte.weight, state["model.wte.weight"])


def per_expert_moe(moe, x: torch.Tensor) -> torch.Tensor:
    """The MoE as the reference computes it: each expert on the tokens routed to it, outputs added in expert order."""
    gates = torch.softmax(torch.nn.functional.linear(x.float(), moe.gate.wg.weight.float()), dim=-1)
    weight, chosen = torch.topk(gates, moe.topk)
    weight = weight / weight.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for e, expert in enumerate(moe.experts):
        token, slot = (chosen == e).nonzero(as_tuple=True)
        out.index_add_(0, token, expert(x[token]) * weight[token, slot, None].to(x.dtype))
    return moe.shared_mlp(x) + out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_moe_is_the_per_expert_loop_after_dtype_changes(adapter, dtype):
    """The experts' weights stay views into the stacked tensors the grouped matmuls read, also after `.to()`
    gave every parameter its own storage; the result is the per-expert loop's, bit for bit."""
    moe = copy.deepcopy(adapter.pipe.model.model.layers[0].mlp).to(dtype)
    for name in ("gate_and_up_proj", "down_proj"):
        for e, expert in enumerate(moe.experts):
            assert getattr(expert, name).weight.data_ptr() == moe.stacked[name][e].data_ptr()
    x = torch.randn(37, moe.gate.wg.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert torch.equal(moe(x), per_expert_moe(moe, x))
