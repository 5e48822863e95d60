"""The one registry: pipeline name -> adapter class and tiny presets, and loading an adapter for a config.

A pipeline is a package `engine_lib/pipelines/<name>/` holding `adapter.py`
(which sets `ADAPTER` to its adapter class) and `tiny.py` (`PRESETS` and
`build(preset, seed)`, the offline random-weight model). Packages are found by
listing this folder, so adding one registers it: nothing here names a pipeline.
Modules are imported on first use, so listing names costs no torch import.
"""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from engine_lib.config import ConfigError, EngineConfig
from engine_lib.modes import select_mode
from engine_lib.pipelines.levers import refuse_levers

if TYPE_CHECKING:  # torch is imported only when a device or dtype is resolved
    import torch

    from engine_lib.pipelines.base import PipelineAdapter

logger = logging.getLogger(__name__)

PIPELINES_DIR = Path(__file__).resolve().parent
REPO_ROOT = PIPELINES_DIR.parents[1]
MODEL_PATH_ENV = "DIFFUSION_MODEL_PATH"


def names() -> list[str]:
    """Every registered pipeline: the packages under engine_lib/pipelines/."""
    return sorted(m.name for m in pkgutil.iter_modules([str(PIPELINES_DIR)]) if m.ispkg)


def _module(name: str, part: str) -> ModuleType:
    if name not in names():
        raise ConfigError(f"parameter 'pipeline': {name!r} is not one of {', '.join(names())}")
    return importlib.import_module(f"engine_lib.pipelines.{name}.{part}")


def get_adapter_class(name: str) -> "type[PipelineAdapter]":
    """The adapter class of pipeline `name` (imported now)."""
    return _module(name, "adapter").ADAPTER


def tiny_module(name: str) -> ModuleType:
    """The tiny-preset module of pipeline `name`: `PRESETS` (preset name -> config) and `build(config, seed)`."""
    return _module(name, "tiny")


def default_model_dir(pipeline: str, preset: str = "tiny") -> Path:
    """Where `make models` saves a tiny preset: `<repo root>/models/<pipeline>-<preset>` (git-ignored)."""
    return REPO_ROOT / "models" / f"{pipeline}-{preset}"


def default_lora_dir(pipeline: str) -> Path:
    """Where `make models` writes the tiny LoRAs of a pipeline: `<repo root>/models/loras/<pipeline>`."""
    return REPO_ROOT / "models" / "loras" / pipeline


def resolve_device(name: str) -> "torch.device":
    """'auto' -> cuda when available, else cpu; otherwise the named device (which must exist)."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"parameter 'device': {name!r} but CUDA is not available on this host (use auto or cpu)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"parameter 'device': {name!r} but this host has {torch.cuda.device_count()} CUDA devices")
    return device


def resolve_dtype(name: str, device: "torch.device") -> "torch.dtype":
    """'auto' -> bfloat16 on cuda, float32 on cpu; otherwise the named torch dtype."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"parameter 'dtype': {name!r} is not a torch dtype")
    return dtype


def model_path_from_env(pipeline: str) -> str:
    """$DIFFUSION_MODEL_PATH_<PIPELINE> (e.g. ..._QWEN_IMAGE), else $DIFFUSION_MODEL_PATH, else ""."""
    return os.environ.get(f"{MODEL_PATH_ENV}_{pipeline.upper()}") or os.environ.get(MODEL_PATH_ENV, "")


def resolve_model_path(config: EngineConfig) -> str:
    """config's model_path, else the environment (see model_path_from_env), else the tiny model's directory."""
    model = config.model
    return model.model_path or model_path_from_env(model.pipeline) or str(default_model_dir(model.pipeline))


def load_adapter(config: EngineConfig) -> "PipelineAdapter":
    """Resolve the config's pipeline, device, dtype and weights, and load the adapter once."""
    model = config.model
    adapter_cls = get_adapter_class(model.pipeline)
    select_mode(config, adapter_cls)  # an unsupported mode fails here, before the weights load
    device = resolve_device(model.device)
    dtype = resolve_dtype(model.dtype, device)
    model_path = resolve_model_path(config)
    if not model.model_path and not model_path_from_env(model.pipeline) and not os.path.isdir(model_path):
        # A hub id or an explicit path is left to from_pretrained; the silent default gets a clear message.
        raise ConfigError(
            f"parameter 'model_path': empty, ${MODEL_PATH_ENV} unset, and the tiny model {model_path!r} "
            "is not built (run `make models`)"
        )
    if not config.lora.lora_dir and model_path == str(default_model_dir(model.pipeline)):
        config = config.replace(lora_dir=str(default_lora_dir(model.pipeline)))  # the tiny model's LoRAs
    refuse_levers(adapter_cls, config.levers, config.parallel)
    adapter = adapter_cls.load(model_path, device, dtype, config)
    if config.parallel.world_size > 1:
        adapter.launch_workers(model_path)
    logger.info("loaded pipeline %s from %s on %s (%s)", model.pipeline, model_path, device, dtype)
    return adapter
