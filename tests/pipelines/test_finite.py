"""Non-finite values never come back as a successful output, on every registered pipeline.

Every FP32 input declares a finite range (a guidance scale of 1e38 gave an all-black image counted as a
success), and a request whose latents become NaN or inf in a denoise step fails alone with INTERNAL naming
the step, while the requests beside it in the same forward finish with their own outputs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine_lib.engine import DiffusionEngine
from engine_lib.hooks import EngineHooks
from engine_lib.interface import InputSpec
from engine_lib.pipelines import registry
from engine_lib.runner import _latents
from tests.helpers.parity_checks import TEST_CONFIG, load_tiny_adapter, parse

NAMES = registry.names()


@pytest.mark.parametrize("name", NAMES)
def test_every_float_input_has_a_finite_range(name):
    for spec in registry.get_adapter_class(name).inputs:
        if spec.datatype == "FP32":
            assert math.isfinite(spec.low) and math.isfinite(spec.high) and spec.high <= 1000, spec


def test_a_float_input_without_a_largest_value_cannot_be_declared():
    with pytest.raises(AssertionError, match="FP32 needs low and high"):
        InputSpec("knob", "FP32", "a knob", low=0)


def poison(prompt: str, before_step: int):
    """A `before_forward` hook: NaN into the latents of the request with `prompt` before its step `before_step`."""
    def hook(states) -> None:
        for state in states:
            if state.params["prompt"] == prompt and state.step_index == before_step - 1:
                with torch.inference_mode():
                    for tensor in _latents(state):
                        tensor.mul_(float("nan"))
    return hook


@pytest.mark.parametrize("name", NAMES)
def test_non_finite_latents_fail_their_request_alone(name):
    adapter = load_tiny_adapter(name, registry.get_adapter_class(name))
    output = adapter.outputs[0].name
    good = parse(adapter, {"prompt": "a photo of a cat", "seed": 3, "num_inference_steps": 3,
                           **adapter.example_inputs()})
    bad = good.replace(prompt="poisoned")
    alone = DiffusionEngine.wave(adapter, TEST_CONFIG, 1).generate({"alone": good})["alone"]
    engine = DiffusionEngine.wave(adapter, TEST_CONFIG, 2, hooks=EngineHooks(before_forward=poison("poisoned", 2)))
    finals = engine.generate({"good": good, "bad": bad})
    total = adapter.total_steps(bad)
    assert [rid for rid, final in finals.items() if not final.ok] == ["bad"] and finals["bad"].error.code == "INTERNAL"
    assert str(finals["bad"].error) == f"non-finite latents after step 2 of {total}"
    levels = np.abs(finals["good"].outputs[output].astype(int) - alone.outputs[output].astype(int))
    assert levels.max() <= 1
    assert engine.runner.num_states == 0


def test_latents_are_read_as_one_tensor_or_one_per_modality():
    video, audio = torch.zeros(2), torch.ones(3)

    class State:
        latents = {"video": video, "audio": audio}

    assert _latents(State()) == [video, audio]
    State.latents = video
    assert _latents(State()) == [video]


@pytest.mark.parametrize("name", NAMES)
def test_every_float_input_at_its_largest_value_gives_a_finite_output(name):
    adapter = load_tiny_adapter(name, registry.get_adapter_class(name))
    schema = adapter.input_schema(TEST_CONFIG)
    largest = {spec.name: (spec.high,) * spec.count if spec.count > 1 else spec.high
               for spec in schema.specs.values() if spec.datatype == "FP32" and not spec.unused}
    needed = {spec.only_with[0]: spec.only_with[1][0] for spec in schema.specs.values()
              if spec.name in largest and spec.only_with}  # a float that acts only with another input's value
    inputs = {"prompt": "a photo of a cat", "seed": 3, "num_inference_steps": 2, **adapter.example_inputs(),
              **needed, **largest}
    if "negative_prompt" in schema.specs and not schema.specs["negative_prompt"].unused:
        inputs["negative_prompt"] = "blurry"  # with it, true CFG runs at its largest scale too
    final = DiffusionEngine.wave(adapter, TEST_CONFIG, 1, float_outputs=True).generate({"r": parse(adapter, inputs)})["r"]
    assert final.ok, final.error
    assert np.isfinite(np.asarray(final.outputs[adapter.outputs[0].name], dtype=np.float64)).all()
