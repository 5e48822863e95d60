"""Compatibility keys: what splits a batch, what must not, and that sched/ never imports torch.

The keys are generic over a pipeline's declaration: "key" inputs enter by value,
"row" inputs never do, the step count only in request keys, and the adapter's
derived fields as given. (Each adapter's own key fields, e.g. CFG, are tested
with the adapter in tests/pipelines.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine_lib.config import EngineConfig
from engine_lib.interface import HEIGHT, NUM_IMAGES, NUM_INFERENCE_STEPS, PREVIEW_INTERVAL, PROMPT, SEED, WIDTH
from engine_lib.interface import InputSchema, output_format
from engine_lib.request import SamplingParams
from engine_lib.sched.keys import RequestBatchKey, StepBatchKey, request_batch_key, step_batch_key

REPO_ROOT = Path(__file__).resolve().parents[2]
SPECS = (PROMPT, HEIGHT, WIDTH, NUM_INFERENCE_STEPS, SEED, NUM_IMAGES, PREVIEW_INTERVAL, output_format("png"))
KEY_INPUTS = tuple(s.name for s in SPECS if s.batch == "key")
SCHEMA = InputSchema("test", SPECS, EngineConfig())


def params(**values) -> SamplingParams:
    """Validated params, as the engine's keys see them."""
    return SCHEMA.parse({"prompt": "a cat", "seed": 0, **values})


def step_key(p, extra=()):
    return step_batch_key(p, KEY_INPUTS, extra)


def request_key(p, extra=()):
    return request_batch_key(p, KEY_INPUTS, extra)


KEY_FNS = [request_key, step_key]


def test_the_declaration_names_the_key_inputs():
    assert KEY_INPUTS == ("height", "width", "num_images")


@pytest.mark.parametrize("key_fn", KEY_FNS)
def test_keys_are_hashable_frozen_and_typed(key_fn):
    key = key_fn(params())
    assert isinstance(key, RequestBatchKey if key_fn is request_key else StepBatchKey)
    assert {key: 1}[key_fn(params())] == 1
    with pytest.raises(AttributeError):
        key.fields = ()  # frozen


@pytest.mark.parametrize("key_fn", KEY_FNS)
def test_per_request_inputs_never_split(key_fn):
    base = key_fn(params())
    assert key_fn(params(seed=123)) == base
    assert key_fn(params(prompt="a completely different prompt")) == base
    assert key_fn(params(preview_interval=2, output_format="png")) == base


def test_step_counts_split_request_keys_but_not_step_keys():
    assert request_key(params(num_inference_steps=4)) != request_key(params(num_inference_steps=8))
    assert step_key(params(num_inference_steps=4)) == step_key(params(num_inference_steps=8))


@pytest.mark.parametrize("key_fn", KEY_FNS)
@pytest.mark.parametrize("a, b", [
    (dict(height=64), dict(height=128)),
    (dict(width=64), dict(width=96)),
    (dict(num_images=1), dict(num_images=2)),
])
def test_tensor_contract_fields_split(key_fn, a, b):
    assert key_fn(params(**a)) != key_fn(params(**b))


@pytest.mark.parametrize("key_fn", KEY_FNS)
@pytest.mark.parametrize("a, b", [
    (dict(height=64), dict()),  # the default, sent or left out
    (dict(num_images=1), dict()),
])
def test_equivalent_spellings_merge(key_fn, a, b):
    assert key_fn(params(**a)) == key_fn(params(**b))
    assert hash(key_fn(params(**a))) == hash(key_fn(params(**b)))


def test_validation_normalises_numbers_so_equal_values_give_equal_keys():
    import numpy as np

    assert step_key(params(height=np.int32(64))) == step_key(params(height=64))
    assert type(params(height=np.int32(64)).height) is int


@pytest.mark.parametrize("key_fn", KEY_FNS)
def test_adapter_extra_fields_split_and_merge(key_fn):
    assert key_fn(params(), extra=(("cfg", True),)) != key_fn(params())
    assert key_fn(params(), extra=(("cfg", True),)) != key_fn(params(), extra=(("cfg", False),))
    assert key_fn(params(), extra=[("cfg", True)]) == key_fn(params(), extra=(("cfg", True),))
    with pytest.raises(TypeError):
        key_fn(params(), extra=(("mask", [1, 2]),))  # unhashable: fails when the key is built


def test_importing_sched_does_not_import_torch():
    code = ("import sys, engine_lib.sched, engine_lib.sched.keys, engine_lib.sched.scheduler, engine_lib.config, "
            "engine_lib.sched.policy, engine_lib.interface; sys.exit(3 if 'torch' in sys.modules else 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"rc={result.returncode} stderr={result.stderr}"
