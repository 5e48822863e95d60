"""The batched flow-match Euler step (`FlowMatchAdapter.step_batch`) and the batch latents it leaves for the
next tick: bit for bit each request's own `scheduler.step`, on Qwen-Image, Flux and SD3 (tiny, CPU float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_lib.pipelines.base import InputBatch
from engine_lib.pipelines.flux.adapter import FluxAdapter
from engine_lib.pipelines.qwen_image.adapter import QwenImageAdapter
from engine_lib.pipelines.sd3.adapter import SD3Adapter
from tests.helpers.parity_checks import Arrival, load_tiny_adapter, parse, run_steps, step_batched_then_alone

ADAPTERS = {"qwen_image": QwenImageAdapter, "flux": FluxAdapter, "sd3": SD3Adapter}


@pytest.fixture(scope="module", params=sorted(ADAPTERS))
def adapter(request):
    return load_tiny_adapter(request.param, ADAPTERS[request.param])


def arrivals():
    """Requests joining at different ticks, with different step counts and two images for one."""
    return [Arrival(0, "a", {"prompt": "a red cube", "num_inference_steps": 6, "seed": 1}),
            Arrival(1, "b", {"prompt": "a blue sphere", "num_inference_steps": 4, "seed": 2, "num_images": 2}),
            Arrival(2, "c", {"prompt": "a green cone", "num_inference_steps": 5, "seed": 3})]


def test_batched_steps_equal_per_request_steps_bit_for_bit(adapter, monkeypatch):
    calls = []
    real = type(adapter).step_batch

    def counting(self, batch, states, prediction):
        stepped = real(self, batch, states, prediction)
        calls.append((len(states), stepped))
        return stepped

    monkeypatch.setattr(type(adapter), "step_batch", counting)
    batched = run_steps(adapter, arrivals(), capacity=3, float_output=True)
    assert any(n > 1 and stepped for n, stepped in calls), calls  # the batched path ran on shared ticks
    monkeypatch.setattr(type(adapter), "step_batch", lambda self, *args: False)
    alone = run_steps(adapter, arrivals(), capacity=3, float_output=True)
    for request_id in ("a", "b", "c"):
        np.testing.assert_array_equal(batched.images[request_id], alone.images[request_id])


def prepared(adapter, *prompts):
    states = []
    for i, prompt in enumerate(prompts):
        state = adapter.new_state(f"r{i}", parse(adapter, {"prompt": prompt, "num_inference_steps": 4, "seed": i}))
        adapter.prepare_encode(state)
        states.append(state)
    return states


@torch.inference_mode()
def test_an_unchanged_batch_reuses_the_stepped_latents_and_a_changed_one_gathers_anew(adapter):
    states = prepared(adapter, "one", "two", "three")
    first = InputBatch.gather(states)
    prediction = torch.randn_like(first["latents"])
    assert adapter.step_batch(first, states, prediction)
    stepped = first["latents"]
    assert all(s.latents.data_ptr() == stepped[rows].data_ptr() for s, rows in zip(states, first.row_slices))
    again = InputBatch.gather(states, previous=first)
    assert again["latents"] is stepped  # no copy: every request still holds the rows it was given
    states[1].latents = states[1].latents.clone()  # a request with new latents of its own: gather copies
    changed = InputBatch.gather(states, previous=again)
    assert changed["latents"] is not stepped and torch.equal(changed["latents"], stepped)
    fewer = InputBatch.gather(states[:2], previous=again)  # membership changed
    assert fewer["latents"] is not stepped and torch.equal(fewer["latents"], stepped[:fewer["latents"].shape[0]])


@torch.inference_mode()
def test_a_batched_step_that_is_not_bit_for_bit_is_switched_off_and_changes_nothing(adapter, monkeypatch):
    import engine_lib.pipelines.flow_match as flow_match

    states = prepared(adapter, "one", "two")
    batch = InputBatch.gather(states)
    before = [s.latents.clone() for s in states]
    monkeypatch.setattr(adapter, "_batched_step_exact", {})
    real = flow_match._euler_step
    monkeypatch.setattr(flow_match, "_euler_step",  # "the device differs": the per-request step gives other bytes
                        lambda scheduler, state, pred: real(scheduler, state, pred) + 1)
    assert not adapter.step_batch(batch, states, torch.randn_like(batch["latents"]))
    assert all(s.step_index == 0 and torch.equal(s.latents, b) for s, b in zip(states, before))
    assert adapter._batched_step_exact == {(torch.float32, "cpu"): False}
    assert not adapter.step_batch(batch, states, torch.randn_like(batch["latents"]))  # decided once


@torch.inference_mode()
def test_a_ragged_batch_steps_request_by_request():
    adapter = load_tiny_adapter("qwen_image", QwenImageAdapter)
    states = []
    for i, size in enumerate((64, 128)):
        state = adapter.new_state(f"r{i}", parse(adapter, {"prompt": "x", "height": size, "width": size,
                                                             "num_inference_steps": 4, "seed": i}))
        adapter.prepare_encode(state)
        states.append(state)
    batch = InputBatch.gather(states)
    assert batch.seq_lens is not None
    assert not adapter.step_batch(batch, states, torch.randn_like(batch["latents"]))


@torch.inference_mode()
def test_a_request_steps_on_alone_after_batched_steps(adapter):
    """E.g. a batch whose next tick is ragged, or whose batched step failed: each scheduler must be where
    the batched steps left it."""
    batched, alone = prepared(adapter, "one", "two"), prepared(adapter, "one", "two")
    step_batched_then_alone(adapter, batched, alone)
    for b, a in zip(batched, alone):
        assert b.step_index == a.step_index == 3
        assert torch.equal(b.latents, a.latents)
