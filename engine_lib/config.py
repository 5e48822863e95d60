"""EngineConfig: every model parameter, its default and its strict parser, in one place.

Triton hands `config.pbtxt` `parameters` over as strings; `EngineConfig.from_parameters`
parses them strictly ("false" is false, "flase" is an error) and names the
parameter and its allowed values in every error. docs/configuration.md is checked
against `EngineConfig` by a test.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from engine_lib.sched.policy import POLICIES

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# `max_<input>` / `default_<input>` parameters a config has unless it sets them (a pipeline's own
# declaration may be stricter: the smaller largest value wins, and a declared default stays).
INPUT_MAX = {"height": 1024, "width": 1024, "num_inference_steps": 100, "num_images": 4, "num_frames": 257,
             "prompt": 4096, "negative_prompt": 4096}  # text inputs: characters
INPUT_DEFAULTS = {"height": "64", "width": "64", "num_inference_steps": "4"}
# the GPU levers' value names (engine_lib/pipelines/levers.py applies them)
COMPILE_MODES = ("none", "regional", "full")
# quantization value -> (the package it needs, what the device must be: "any" or "cuda")
QUANTIZATIONS = {"none": ("", "any"), "int8_weight_only": ("torchao", "any"), "int8": ("torchao", "any"),
                 "fp8_weight_only": ("torchao", "any"), "fp8": ("torchao", "cuda"),
                 "int4_weight_only": ("torchao", "cuda"), "nf4": ("bitsandbytes", "cuda")}
OFFLOAD_MODES = ("none", "model", "group")


class ConfigError(ValueError):
    """A model configuration parameter is invalid; raised at load, names the parameter."""


@dataclass(frozen=True)
class EngineConfig:
    """One model instance's engine settings (see docs/configuration.md)."""

    # what runs, and where
    pipeline: str = "qwen_image"
    model_path: str = ""  # empty: $DIFFUSION_MODEL_PATH_<PIPELINE>, $DIFFUSION_MODEL_PATH, else the tiny model
    device: str = "auto"  # auto: cuda if available, else cpu; or cpu, cuda, cuda:N
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    warmup: bool = True
    # how requests share a forward
    step_execution: bool = False
    max_num_seqs: int = 1
    request_batch_max_wait_ms: float = 0.0
    max_batch_tokens: int = 0  # latent tokens (x rows) one forward may hold, besides max_num_seqs; 0: no limit
    # latent tokens x rows one request may add to a forward (bounds one forward's time); auto: the pipeline's
    # default (PipelineAdapter.default_max_request_cost), 0: no limit
    max_request_cost: str = "auto"
    cfg_batching: bool = True  # CFG cond+uncond as one forward of 2B rows (false: two forwards)
    mixed_size_batching: bool = False  # step mode: different image sizes share a forward (Qwen-Image, Flux, SD3: packed)
    # several devices for one model (engine_lib/parallel.py: one worker process per rank; docs/deployment.md)
    cfg_parallel: bool = False  # a CFG tick's cond rows on one worker process, its uncond rows on another (Qwen-Image)
    sequence_parallel_size: int = 1  # ranks that split each forward's latent tokens (Ulysses attention)
    tensor_parallel_size: int = 1  # ranks that split attention heads and MLPs (HunyuanImage-3.0)
    expert_parallel: bool = False  # with tensor_parallel_size > 1: the MoE experts spread over those ranks
    devices: str = ""  # the ranks' devices, comma-separated (cuda:0,cuda:1); empty: cuda:0..N-1 on a GPU host, else cpu
    # who goes first
    scheduling_policy: str = "arrival"  # engine_lib/sched/policy.py: arrival, shortest_remaining, deadline, ...
    priority_levels: int = 3  # the `priority` input's levels: 1 most urgent ... priority_levels least
    default_priority_level: int = 2  # a request without `priority` (or with 0)
    max_preemptions: int = 1  # step mode: times one request may be paused for a more urgent one (0: never)
    # text encoding
    max_sequence_length: int = 0  # text tokens per prompt; 0: the pipeline's own default
    prompt_cache_mb: int = 256  # prompt embeddings kept for repeated prompts (MiB, least recently used first); 0: off
    # LoRA per request (engine_lib/lora.py)
    lora_dir: str = ""  # folder of <name>.safetensors; empty: models/loras/<pipeline> when serving the tiny model
    max_loras: int = 4  # LoRAs kept loaded at once (least recently used unloaded first)
    # GPU levers through diffusers' own machinery (engine_lib/pipelines/levers.py)
    compile: str = "none"  # none, regional (the transformer's repeated blocks), full (and its whole forward)
    compile_backend: str = "inductor"  # torch.compile's backend (aot_eager: dynamo's graphs and guards, no codegen)
    quantization: str = "none"  # none, int8_weight_only, int8, fp8_weight_only, fp8, int4_weight_only, nf4
    quantize_components: str = "transformer"  # comma-separated pipeline components `quantization` applies to
    attention_backend: str = ""  # a diffusers attention dispatcher backend (native, flex, flash, ...); empty: default
    offload: str = "none"  # none, model, group (weights kept on the CPU, each leaf moved to the device when it runs)
    vae_tiling: bool = False  # the VAE decodes in overlapping tiles (bounded memory for large images and videos)
    # what one request may ask for, checked at the Triton edge
    input_max: Mapping[str, float] = field(default_factory=lambda: dict(INPUT_MAX))  # `max_<input>` parameters
    input_defaults: Mapping[str, str] = field(default_factory=lambda: dict(INPUT_DEFAULTS))  # `default_<input>`
    max_queue: int = 64

    @classmethod
    def from_parameters(cls, params: Mapping[str, Any]) -> "EngineConfig":
        """Parse Triton `parameters` (string values, or Triton's {"string_value": ...} dicts)."""
        known = {f.name: f for f in fields(cls) if f.name not in ("input_max", "input_defaults")}
        values: dict[str, Any] = {"input_max": dict(INPUT_MAX), "input_defaults": dict(INPUT_DEFAULTS)}
        for name, raw in params.items():
            if isinstance(raw, Mapping):
                raw = raw.get("string_value", "")
            near = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
            if name in known:
                values[name] = _parse(name, known[name].type, str(raw))
            elif near:  # `max_num_seq` is a typo of `max_num_seqs`, not the limit of an input "num_seq"
                raise ConfigError(f"unknown parameter '{name}' (did you mean '{near[0]}'?)")
            elif name.startswith("max_") and len(name) > 4:  # the pipeline's declaration checks the input name
                limit = _parse(name, float, str(raw))
                values["input_max"][name[4:]] = int(limit) if limit.is_integer() else limit
            elif name.startswith("default_") and len(name) > 8:
                values["input_defaults"][name[8:]] = str(raw).strip()
            else:
                raise ConfigError(f"unknown parameter '{name}'; known parameters: {', '.join(sorted(known))}, "
                                  "max_<input>, default_<input>")
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        self._check_lever_names()
        if self.device not in DEVICES and not re.fullmatch(r"cuda:\d+", self.device):
            raise ConfigError(f"parameter 'device': {self.device!r} is not one of {', '.join(DEVICES)}, cuda:N")
        if self.dtype not in DTYPES:
            raise ConfigError(f"parameter 'dtype': {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if not math.isfinite(self.request_batch_max_wait_ms) or self.request_batch_max_wait_ms < 0:
            raise ConfigError(
                f"parameter 'request_batch_max_wait_ms': {self.request_batch_max_wait_ms} must be a finite number >= 0"
            )
        if self.max_sequence_length < 0:
            raise ConfigError(f"parameter 'max_sequence_length': {self.max_sequence_length} must be >= 0 "
                              "(0: the pipeline's default)")
        if not 1 <= self.default_priority_level <= self.priority_levels:
            raise ConfigError(f"parameter 'default_priority_level': {self.default_priority_level} must be in "
                              f"[1, priority_levels={self.priority_levels}]")
        for name in ("max_preemptions", "max_batch_tokens", "prompt_cache_mb"):
            if getattr(self, name) < 0:
                raise ConfigError(f"parameter '{name}': {getattr(self, name)} must be an integer >= 0")
        if self.scheduling_policy not in POLICIES:
            raise ConfigError(f"parameter 'scheduling_policy': {self.scheduling_policy!r} is not one of "
                              f"{', '.join(POLICIES)}")
        for name in ("max_num_seqs", "priority_levels", "max_loras", "max_queue"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parameter '{name}': {getattr(self, name)} must be an integer >= 1")
        for name in ("sequence_parallel_size", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parameter '{name}': {getattr(self, name)} must be an integer >= 1")
        if self.devices and len(self.device_list()) != self.world_size:
            raise ConfigError(f"parameter 'devices': {self.devices!r} names {len(self.device_list())} device(s); "
                              f"this instance runs {self.world_size} rank(s)")
        if self.max_request_cost != "auto" and not re.fullmatch(r"\d+", self.max_request_cost):
            raise ConfigError(f"parameter 'max_request_cost': {self.max_request_cost!r} must be auto or an integer "
                              ">= 0 (0: no limit)")
        for name, value in self.input_max.items():
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"parameter 'max_{name}': {value} must be a finite number >= 0")

    @property
    def world_size(self) -> int:
        """Worker processes (ranks) this instance runs besides its own: 1 means none (one process)."""
        return (2 if self.cfg_parallel else 1) * self.sequence_parallel_size * self.tensor_parallel_size

    def device_list(self) -> list[str]:
        return [d.strip() for d in self.devices.split(",") if d.strip()]

    def quantized_components(self) -> tuple:
        return tuple(c.strip() for c in self.quantize_components.split(",") if c.strip())

    def _check_lever_names(self) -> None:
        """The lever parameters' values are known names (no torch)."""
        for name, value, allowed in (("compile", self.compile, COMPILE_MODES),
                                     ("quantization", self.quantization, tuple(QUANTIZATIONS)),
                                     ("offload", self.offload, OFFLOAD_MODES)):
            if value not in allowed:
                raise ConfigError(f"parameter '{name}': {value!r} is not one of {', '.join(allowed)}")
        if not self.quantized_components():
            raise ConfigError("parameter 'quantize_components': names no component (default: transformer)")

    def request_cost_limit(self, pipeline_default: int) -> int:
        """The most latent tokens x rows one request may add to a forward (0: no limit): `max_request_cost`, or
        the pipeline's default for `auto`."""
        return pipeline_default if self.max_request_cost == "auto" else int(self.max_request_cost)

    def replace(self, **changes: Any) -> "EngineConfig":
        config = dataclasses.replace(self, **changes)
        config.validate()
        return config


def _parse(name: str, type_name: Any, raw: str) -> Any:
    text = raw.strip()
    if type_name in (bool, "bool"):
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ConfigError(f"parameter '{name}': {raw!r} is not a boolean (use true/false, 1/0, yes/no, on/off)")
    if type_name in (int, "int"):
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"parameter '{name}': {raw!r} is not an integer") from None
    if type_name in (float, "float"):
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"parameter '{name}': {raw!r} is not a number") from None
    return text
