"""Compatibility keys: which requests may share one batched forward.

A key holds only the fields that shape the batched tensor contract (sizes,
output count, CFG mode and scale, guidance, LoRA, text length), normalised so
that equivalent spellings (2 vs 2.0, lora "" vs None, a negative prompt with
CFG off vs none) give one key. Seeds and prompts never enter a key: they are
per-request inputs the batch carries row by row. Step keys leave out the step
count (requests at different steps share a tick); request keys include it
(one fused forward runs one schedule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine_lib.request import SamplingParams


@dataclass(frozen=True)
class StepBatchKey:
    """What requests advanced together one denoise step at a time must share."""

    height: int
    width: int
    num_frames: Optional[int]
    num_images: int
    do_true_cfg: bool
    true_cfg_scale: Optional[float]  # None when CFG is off: the scale is unused then
    guidance_scale: Optional[float]
    lora_name: Optional[str]
    lora_scale: Optional[float]  # None without a LoRA
    max_sequence_length: Optional[int]
    extra: tuple = ()  # adapter-specific fields (PipelineAdapter.key_fields)


@dataclass(frozen=True)
class RequestBatchKey:
    """What requests run as one fused request-level forward must share: the step key and the schedule."""

    step_key: StepBatchKey
    num_inference_steps: int


def _optional_float(value: Optional[float]) -> Optional[float]:
    return None if value is None else float(value)


def _optional_int(value: Optional[int]) -> Optional[int]:
    return None if value is None else int(value)


def step_batch_key(params: SamplingParams, extra: tuple = (), per_row_guidance: bool = False) -> StepBatchKey:
    """The step-mode key: step counts and current step indices may differ.

    per_row_guidance: the pipeline takes a guidance value per row (embedded
    guidance, as Flux), so guidance_scale does not split batches.
    """
    do_cfg = params.do_true_cfg
    lora_name = params.lora_name or None  # "" means no LoRA
    key = StepBatchKey(
        height=int(params.height),
        width=int(params.width),
        num_frames=_optional_int(params.num_frames),
        num_images=int(params.num_images),
        do_true_cfg=do_cfg,
        true_cfg_scale=float(params.true_cfg_scale) if do_cfg else None,
        guidance_scale=None if per_row_guidance else _optional_float(params.guidance_scale),
        lora_name=lora_name,
        lora_scale=float(params.lora_scale) if lora_name is not None else None,
        max_sequence_length=_optional_int(params.max_sequence_length),
        extra=tuple(extra),
    )
    hash(key)  # an unhashable adapter field fails here, at admission, not deep in the scheduler
    return key


def request_batch_key(params: SamplingParams, extra: tuple = (), per_row_guidance: bool = False) -> RequestBatchKey:
    """The request-mode key: the step key's fields plus the step count."""
    return RequestBatchKey(step_batch_key(params, extra, per_row_guidance), int(params.num_inference_steps))
