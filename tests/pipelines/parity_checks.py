"""Shared parity checks for pipeline adapters: a minimal step driver and image comparisons.

The driver is what the engine's runner does each tick, and nothing more: admit
arrivals up to a capacity (`prepare_encode`), gather one InputBatch, one
`denoise_step`, split, `step_scheduler` per request, previews, and one
`post_decode` for the requests that finished in the same tick.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from engine_lib.pipelines.base import InputBatch, PipelineAdapter, StepRequestState
from engine_lib.request import SamplingParams

# Batch-size dependent CPU float32 kernels move pixels by about 1e-6 (measured; see
# docs/pipelines.md); this bound is two orders of magnitude above that.
FLOAT_BOUND = 1e-4
MAX_UINT8_CHANGED_FRACTION = 0.001  # pixels allowed to differ, by at most 1 level


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
