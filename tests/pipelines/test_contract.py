"""The contract's building blocks without a model: schedules in phases, and batches of states that
carry several per-row tensors (as a video + audio pipeline's would)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from engine_lib.pipelines.base import InputBatch, RequestState, Schedule
from engine_lib.request import SamplingParams


def test_a_schedule_in_phases_counts_steps_across_them():
    schedule = Schedule([torch.tensor([900.0, 500.0]), torch.tensor([800.0, 400.0, 100.0])])
    assert schedule.num_steps == 5
    assert [schedule.locate(i) for i in range(5)] == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    assert [float(schedule.timestep(i)) for i in range(5)] == [900.0, 500.0, 800.0, 400.0, 100.0]
    with pytest.raises(IndexError):
        schedule.locate(5)


@dataclass
class AudioVideoState(RequestState):
    """Two latents per request, each with its own rows' timesteps."""

    video: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    audio: torch.Tensor = field(default_factory=lambda: torch.zeros(0))

    @property
    def num_rows(self) -> int:
        return int(self.video.shape[0])

    def step_inputs(self) -> dict[str, torch.Tensor]:
        return {"video": self.video, "audio": self.audio,
                "timesteps": torch.full((self.num_rows,), float(self.step_index))}


def state(request_id: str, rows: int, step: int, fill: float) -> AudioVideoState:
    return AudioVideoState(request_id, SamplingParams(prompt=request_id), step_index=step, num_steps=10,
                           video=torch.full((rows, 2, 3), fill), audio=torch.full((rows, 4), fill))


def test_input_batch_gathers_every_named_tensor_and_splits_dict_predictions_back():
    states = [state("a", rows=1, step=3, fill=1.0), state("b", rows=2, step=0, fill=2.0)]
    batch = InputBatch.gather(states)
    assert batch["video"].shape == (3, 2, 3) and batch["audio"].shape == (3, 4)
    assert batch["timesteps"].tolist() == [3.0, 0.0, 0.0]
    pred = {"video": batch["video"] * 10, "audio": batch["audio"] * 10}
    a, b = batch.split(pred)
    assert a["video"].shape == (1, 2, 3) and float(a["audio"][0, 0]) == 10.0
    assert b["video"].shape == (2, 2, 3) and float(b["audio"][1, 3]) == 20.0


def test_the_batch_cache_survives_only_while_membership_holds():
    a, b = state("a", 1, 0, 1.0), state("b", 1, 0, 2.0)
    first = InputBatch.gather([a, b])
    first.cache["text"] = "batched once"
    assert InputBatch.gather([a, b], previous=first).cache == {"text": "batched once"}
    assert InputBatch.gather([a], previous=first).cache == {}
