"""A paused (preempted) request's step state can leave the device: `move_tensors` reaches every tensor of
a real prepared state, so `ModelRunner.pause` frees its GPU memory (it moves states only on a GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_lib.pipelines import registry
from engine_lib.pipelines.base import move_tensors
from engine_lib.request import DiffusionRequest
from engine_lib.runner import ModelRunner
from tests.helpers.parity_checks import load_tiny_adapter, parse


def tensors_of(obj) -> list[torch.Tensor]:
    """Every tensor reachable through dataclass fields, dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in tensors_of(getattr(obj, f.name))]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v)]
    return []


@pytest.mark.parametrize("name", registry.names())
def test_every_tensor_of_a_prepared_state_moves(name):
    adapter = load_tiny_adapter(name, registry.get_adapter_class(name))
    runner = ModelRunner(adapter)
    request = DiffusionRequest("r", parse(adapter, {"prompt": "a cat", "num_inference_steps": 2, "seed": 1,
                                                    **adapter.example_inputs()}))
    runner.execute_step([request], [])
    state = runner.states["r"]
    before = tensors_of(state)
    assert before and all(t.device.type == "cpu" for t in before)
    move_tensors(state, torch.device("meta"))
    after = tensors_of(state)
    assert len(after) == len(before) and all(t.device.type == "meta" for t in after)


def test_pause_is_a_no_op_on_the_cpu():
    adapter = load_tiny_adapter("qwen_image", registry.get_adapter_class("qwen_image"))
    runner = ModelRunner(adapter)
    request = DiffusionRequest("r", parse(adapter, {"prompt": "a cat", "num_inference_steps": 3, "seed": 1}))
    runner.execute_step([request], [])
    latents = runner.states["r"].latents
    runner.pause(["r"])
    assert runner.states["r"].latents is latents
    request.step_index = 1
    runner.execute_step([], [request])  # resumes as a running request
    assert runner.states["r"].step_index == 2
