"""Compatibility keys: which requests may share one batched forward.

A key holds only what shapes the batched tensor contract. Which inputs that is
comes from the pipeline's declaration (`InputSpec.batch`, engine_lib/interface.py):
"key" inputs enter by value (sizes, output count), "row" inputs never do (seeds,
prompts: each row carries its own), "steps" (the step count) enters request keys
only, and "adapter" inputs enter through the adapter's derived `key_fields`
(a CFG scale matters only with CFG on). Validated params hold normalised values
(ints as ints, floats as floats), so equal inputs give equal keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping


@dataclass(frozen=True)
class StepBatchKey:
    """What requests advanced together one denoise step at a time must share: (name, value) pairs."""

    fields: tuple[tuple[str, Hashable], ...]


@dataclass(frozen=True)
class RequestBatchKey:
    """What requests run as one request-mode wave must share: the step key and the step count."""

    step_key: StepBatchKey
    num_inference_steps: int


def step_batch_key(params: Mapping[str, Hashable], key_inputs: Iterable[str], extra: Iterable = ()) -> StepBatchKey:
    """The step-mode key: the "key" inputs by value plus the adapter's derived fields.

    Step counts and current step indices may differ within it.
    """
    key = StepBatchKey(tuple((name, params[name]) for name in key_inputs) + tuple(extra))
    hash(key)  # an unhashable adapter field fails here, at admission, not deep in the scheduler
    return key


def request_batch_key(params: Mapping[str, Hashable], key_inputs: Iterable[str], extra: Iterable = ()) -> RequestBatchKey:
    """The request-mode key: the step key's fields plus the step count (one wave runs one schedule)."""
    return RequestBatchKey(step_batch_key(params, key_inputs, extra), int(params["num_inference_steps"]))
