"""LoRA parity helpers: diffusers itself with the same LoRA active (a second copy of the pipeline with
`load_lora_weights` and `set_adapters`), and the one-level bound a LoRA row keeps against its reference."""

from __future__ import annotations

import diffusers
import numpy as np
import torch

from engine_lib.pipelines import registry
from tests.helpers.parity_checks import MAX_UINT8_CHANGED_FRACTION, parse


def assert_within_one_level(actual: np.ndarray, expected: np.ndarray, what: str = "") -> None:
    levels = np.abs(actual.astype(np.int16) - expected.astype(np.int16))
    assert levels.max() <= 1 and (levels > 0).mean() <= MAX_UINT8_CHANGED_FRACTION, what


def diffusers_with_lora(adapter, model_dir, lora_dir, name, scale, inputs) -> np.ndarray:
    """What diffusers makes of the same request with the LoRA active at `scale` (its images, or its video)."""
    pipeline_cls = getattr(diffusers, registry.get_adapter_class(adapter.name).pipeline_class)
    pipe = pipeline_cls.from_pretrained(str(model_dir), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora_dir / f"{name}.safetensors"), adapter_name=name)
    pipe.set_adapters([name], [scale])
    return getattr(pipe(**adapter.pipe_kwargs(parse(adapter, inputs)), output_type="np"), adapter.outputs[0].pipe_output)
