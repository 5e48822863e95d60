"""What every registered pipeline must satisfy, read from its declaration alone.

A new pipeline (engine_lib/pipelines/<name>/) is checked here without a test of
its own: its declaration is consistent, its tiny preset builds and loads through
the registry, and one request with every input left at its default, run through
the engine's ModelRunner, is bitwise the diffusers pipeline's own output.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine_lib.interface import BATCH_ROLES, to_uint8
from engine_lib.pipelines import registry
from engine_lib.pipelines.base import PipelineAdapter
from engine_lib.serving.tensors import ENCODERS
from tests.helpers.parity_checks import load_tiny_adapter, parse, pipe_reference, solo_steps, with_cfg_batching

NAMES = registry.names()


def test_the_registry_lists_the_pipeline_packages():
    assert {"qwen_image", "flux", "sd3"} <= set(NAMES)
    for name in NAMES:
        assert registry.get_adapter_class(name).name == name


@pytest.mark.parametrize("name", NAMES)
def test_the_declaration_is_consistent(name):
    cls = registry.get_adapter_class(name)
    inputs = {spec.name: spec for spec in cls.inputs}
    assert len(inputs) == len(cls.inputs), "input names are unique"
    assert inputs["prompt"].required and inputs["num_inference_steps"].batch == "steps"
    assert all(spec.batch in BATCH_ROLES for spec in cls.inputs)
    assert all(not spec.required or spec.name == "prompt" for spec in cls.inputs), "only prompt is required"
    # Previews: declared input <-> capability <-> an implementation (the other features: test_capabilities.py).
    assert cls.capabilities.supports("previews") == ("preview_interval" in inputs)
    assert cls.capabilities.supports("previews") == (cls.preview is not PipelineAdapter.preview)
    # output_format offers exactly raw plus the declared outputs' encodings, each with an encoder.
    encodings = {fmt for out in cls.outputs for fmt in out.encodings}
    assert set(inputs["output_format"].choices) == {"raw"} | encodings
    assert encodings <= set(ENCODERS)
    assert cls.outputs[0].pipe_output, "the first output names the pipeline output it is (parity is checked on it)"
    if getattr(cls, "cfg_kind", "") == "true_cfg":
        assert {"negative_prompt", "true_cfg_scale"} <= set(inputs)
    if getattr(cls, "cfg_kind", "") == "cfg":
        assert "guidance_scale" in inputs and "true_cfg_scale" not in inputs


@pytest.mark.parametrize("name", NAMES)
def test_a_request_left_at_its_defaults_is_the_pipelines_own_output(name):
    adapter = load_tiny_adapter(name, registry.get_adapter_class(name))
    if not getattr(adapter, "diffusers_cfg_batching", True):  # CFG on by default, run as diffusers runs it
        adapter = with_cfg_batching(adapter, False)
    inputs = {"prompt": "a photo of a cat", "seed": 3, **adapter.example_inputs()}
    params = parse(adapter, inputs)
    expected = pipe_reference(adapter)(params)
    np.testing.assert_array_equal(solo_steps(adapter, params, float_output=True), expected)
    np.testing.assert_array_equal(solo_steps(adapter, params), to_uint8(expected))
