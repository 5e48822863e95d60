"""The loader of a diffusers adapter: its pipeline class's `from_pretrained`, with the GPU levers (levers.py)
applied at load, wrapped in the adapter."""

from __future__ import annotations

from typing import Any, Optional

import torch

from engine_lib.config import EngineConfig, LeversConfig


def load_diffusers(cls: Any, model_path: str, device: torch.device, dtype: torch.dtype,
                   config: Optional[EngineConfig] = None) -> Any:
    """An instance of the adapter class `cls` (a DiffusersAdapter) of its `pipeline_class` loaded from `model_path`."""
    import diffusers

    from engine_lib.pipelines import levers

    chosen = config.levers if config is not None else LeversConfig()
    quantization = levers.quantization_config(chosen, str(model_path), torch.device(device))
    pipe = getattr(diffusers, cls.pipeline_class).from_pretrained(
        str(model_path), dtype=dtype,  # not torch_dtype
        **({"quantization_config": quantization} if quantization is not None else {}),
        **cls.from_pretrained_kwargs(str(model_path)))
    applied = levers.apply(pipe, torch.device(device), chosen)  # on the device (or offloaded), compiled, ...
    pipe.set_progress_bar_config(disable=True)
    adapter = cls(pipe, torch.device(device), dtype, config)
    adapter.levers = applied
    return adapter
