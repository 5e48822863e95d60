"""Compatibility keys: what splits a batch, what must not, and that sched/ never imports torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine_lib.request import SamplingParams
from engine_lib.sched.keys import RequestBatchKey, StepBatchKey, request_batch_key, step_batch_key

KEY_FNS = [request_batch_key, step_batch_key]
REPO_ROOT = Path(__file__).resolve().parents[2]


def params(**overrides) -> SamplingParams:
    return SamplingParams(prompt="a cat", **overrides)


@pytest.mark.parametrize("key_fn", KEY_FNS)
def test_keys_are_hashable_frozen_and_typed(key_fn):
    key = key_fn(params())
    assert isinstance(key, RequestBatchKey if key_fn is request_batch_key else StepBatchKey)
    assert {key: 1}[key_fn(params())] == 1
    with pytest.raises(AttributeError):
        key.num_images = 2  # frozen


@pytest.mark.parametrize("key_fn", KEY_FNS)
def test_per_request_inputs_never_split(key_fn):
    base = key_fn(params())
    assert key_fn(params(seed=123)) == base
    assert key_fn(SamplingParams(prompt="a completely different prompt")) == base
    assert key_fn(params(preview_interval=2, output_format="png")) == base


def test_step_counts_split_request_keys_but_not_step_keys():
    assert request_batch_key(params(num_inference_steps=4)) != request_batch_key(params(num_inference_steps=8))
    assert step_batch_key(params(num_inference_steps=4)) == step_batch_key(params(num_inference_steps=8))


@pytest.mark.parametrize("key_fn", KEY_FNS)
@pytest.mark.parametrize("a, b", [
    (dict(height=64), dict(height=128)),
    (dict(width=64), dict(width=96)),
    (dict(num_frames=9), dict(num_frames=17)),
    (dict(num_frames=None), dict(num_frames=9)),
    (dict(num_images=1), dict(num_images=2)),
    (dict(), dict(negative_prompt="blurry", true_cfg_scale=4.0)),  # CFG off vs on
    (dict(negative_prompt="x", true_cfg_scale=2.0), dict(negative_prompt="x", true_cfg_scale=4.0)),
    (dict(guidance_scale=None), dict(guidance_scale=3.5)),
    (dict(guidance_scale=3.5), dict(guidance_scale=5.0)),
    (dict(), dict(lora_name="style_a")),
    (dict(lora_name="style_a"), dict(lora_name="style_b")),
    (dict(lora_name="style_a", lora_scale=0.5), dict(lora_name="style_a", lora_scale=1.0)),
    (dict(max_sequence_length=None), dict(max_sequence_length=128)),
    (dict(max_sequence_length=128), dict(max_sequence_length=256)),
])
def test_tensor_contract_fields_split(key_fn, a, b):
    assert key_fn(params(**a)) != key_fn(params(**b))


@pytest.mark.parametrize("key_fn", KEY_FNS)
@pytest.mark.parametrize("a, b", [
    (dict(negative_prompt="x", true_cfg_scale=2), dict(negative_prompt="x", true_cfg_scale=2.0)),
    (dict(guidance_scale=4), dict(guidance_scale=4.0)),
    (dict(lora_name="style_a", lora_scale=1), dict(lora_name="style_a", lora_scale=1.0)),
    (dict(lora_name=""), dict(lora_name=None)),
    (dict(lora_name=None, lora_scale=0.3), dict()),  # scale without a LoRA is unused
    (dict(lora_name="", lora_scale=0.3), dict()),
    (dict(negative_prompt="blurry", true_cfg_scale=1.0), dict()),  # negative prompt with CFG off
    (dict(negative_prompt="blurry", true_cfg_scale=0.5), dict(true_cfg_scale=7.0)),  # no CFG: scale unused
    (dict(guidance_scale=None), dict()),
    (dict(negative_prompt="blurry", true_cfg_scale=4.0), dict(negative_prompt="sharp", true_cfg_scale=4.0)),
])
def test_equivalent_spellings_merge(key_fn, a, b):
    assert key_fn(params(**a)) == key_fn(params(**b))
    assert hash(key_fn(params(**a))) == hash(key_fn(params(**b)))


@pytest.mark.parametrize("key_fn", KEY_FNS)
def test_cfg_needs_a_negative_prompt(key_fn):
    # true_cfg_scale > 1 without a negative prompt is no CFG (as diffusers' Qwen-Image)
    assert key_fn(params(true_cfg_scale=4.0)) == key_fn(params())
    assert key_fn(params(negative_prompt="", true_cfg_scale=4.0)) != key_fn(params())


@pytest.mark.parametrize("key_fn", KEY_FNS)
def test_adapter_extra_fields_split_and_merge(key_fn):
    assert key_fn(params(), extra=("mask",)) != key_fn(params())
    assert key_fn(params(), extra=("mask",)) != key_fn(params(), extra=("no_mask",))
    assert key_fn(params(), extra=["mask"]) == key_fn(params(), extra=("mask",))
    with pytest.raises(TypeError):
        key_fn(params(), extra=([1, 2],))  # unhashable: fails when the key is built


def test_importing_sched_does_not_import_torch():
    code = ("import sys, engine_lib.sched, engine_lib.sched.keys, engine_lib.sched.request_scheduler, "
            "engine_lib.sched.step_scheduler; sys.exit(3 if 'torch' in sys.modules else 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"rc={result.returncode} stderr={result.stderr}"


def test_per_row_guidance_lets_guidance_scales_share_a_batch():
    """Flux takes guidance per row: different guidance_scale values share both keys; elsewhere they split."""
    from engine_lib.sched.keys import request_batch_key, step_batch_key

    a, b = params(guidance_scale=2.0), params(guidance_scale=5.0)
    for key in (step_batch_key, request_batch_key):
        assert key(a) != key(b)
        assert key(a, per_row_guidance=True) == key(b, per_row_guidance=True)
