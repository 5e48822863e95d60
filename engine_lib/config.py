"""EngineConfig: every model parameter, its default and its strict parser, in one place.

The parameters come in groups, as vLLM's config does: what runs and where (`model`), who shares a
forward and who goes first (`scheduler`), several devices (`parallel`), the prompt cache (`cache`),
LoRA (`lora`), the GPU levers (`levers`) and what one request may ask for (`limits`). Each part of the
engine takes its group. config.pbtxt names stay flat (`max_num_seqs`, not `scheduler.max_num_seqs`):
a flat name belongs to exactly one group.

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


def _param(default: Any, *, low: Any = None, choices: Any = None) -> Any:
    """A parameter with its default and the one check `validate` makes of it: at least `low`, or one of `choices`."""
    return field(default=default, metadata={"low": low, "choices": choices})


@dataclass(frozen=True)
class ModelConfig:
    """What runs, and where; how the pipeline's own forwards batch."""

    pipeline: str = "qwen_image"
    model_path: str = ""  # empty: $DIFFUSION_MODEL_PATH_<PIPELINE>, $DIFFUSION_MODEL_PATH, else the tiny model
    device: str = "auto"  # auto: cuda if available, else cpu; or cpu, cuda, cuda:N
    dtype: str = _param("auto", choices=DTYPES)  # auto: bfloat16 on cuda, float32 on cpu
    warmup: bool = True
    max_sequence_length: int = _param(0, low=0)  # text tokens per prompt; 0: the pipeline's own default
    cfg_batching: bool = True  # CFG cond+uncond as one forward of 2B rows (false: two forwards)
    mixed_size_batching: bool = False  # step mode: different sizes share a forward (packed: Qwen-Image, Flux, SD3)


@dataclass(frozen=True)
class SchedulerConfig:
    """Which requests share a forward, and who goes first (engine_lib/sched)."""

    step_execution: bool = False
    max_num_seqs: int = _param(1, low=1)
    request_batch_max_wait_ms: float = _param(0.0, low=0)
    max_batch_tokens: int = _param(0, low=0)  # latent tokens (x rows) a forward may hold besides max_num_seqs; 0: any
    # latent tokens x rows one request may add to a forward (bounds one forward's time); auto: the pipeline's
    # default (PipelineAdapter.default_max_request_cost), 0: no limit
    max_request_cost: str = "auto"
    scheduling_policy: str = _param("arrival", choices=tuple(POLICIES))  # arrival, shortest_remaining, deadline, ...
    priority_levels: int = _param(3, low=1)  # the `priority` input's levels: 1 most urgent ... priority_levels least
    default_priority_level: int = 2  # a request without `priority` (or with 0)
    max_preemptions: int = _param(1, low=0)  # step mode: times a request may pause for a more urgent one (0: never)

    @property
    def admission_wait_s(self) -> float:
        return self.request_batch_max_wait_ms / 1000.0

    def request_cost_limit(self, pipeline_default: int) -> int:
        """The most latent tokens x rows one request may add to a forward (0: no limit): `max_request_cost`, or
        the pipeline's default for `auto`."""
        return pipeline_default if self.max_request_cost == "auto" else int(self.max_request_cost)


@dataclass(frozen=True)
class ParallelConfig:
    """Several devices for one model (engine_lib/parallel.py: one worker process per rank; docs/deployment.md)."""

    cfg_parallel: bool = False  # a CFG tick's cond rows on one worker process, its uncond rows on another (Qwen-Image)
    sequence_parallel_size: int = _param(1, low=1)  # ranks that split each forward's latent tokens (Ulysses attention)
    tensor_parallel_size: int = _param(1, low=1)  # ranks that split attention heads and MLPs (HunyuanImage-3.0)
    expert_parallel: bool = False  # with tensor_parallel_size > 1: the MoE experts spread over those ranks
    devices: str = ""  # the ranks' devices, comma-separated (cuda:0,cuda:1); empty: cuda:0..N-1 on a GPU host, else cpu

    @property
    def world_size(self) -> int:
        """Worker processes (ranks) this instance runs besides its own: 1 means none (one process)."""
        return (2 if self.cfg_parallel else 1) * self.sequence_parallel_size * self.tensor_parallel_size

    def device_list(self) -> list[str]:
        return [d.strip() for d in self.devices.split(",") if d.strip()]


@dataclass(frozen=True)
class CacheConfig:
    """What is kept between requests."""

    prompt_cache_mb: int = _param(256, low=0)  # prompt embeddings kept for repeated prompts (MiB, LRU first); 0: off


@dataclass(frozen=True)
class LoraConfig:
    """LoRA per request (engine_lib/lora.py)."""

    lora_dir: str = ""  # folder of <name>.safetensors; empty: models/loras/<pipeline> when serving the tiny model
    max_loras: int = _param(4, low=1)  # LoRAs kept loaded at once (least recently used unloaded first)


@dataclass(frozen=True)
class LeversConfig:
    """GPU levers through diffusers' own machinery (engine_lib/pipelines/levers.py applies them)."""

    compile: str = _param("none", choices=COMPILE_MODES)  # none, regional (repeated blocks), full (+ whole forward)
    compile_backend: str = "inductor"  # torch.compile's backend (aot_eager: dynamo's graphs and guards, no codegen)
    quantization: str = _param("none", choices=tuple(QUANTIZATIONS))  # none, int8_weight_only, int8, fp8, nf4, ...
    quantize_components: str = "transformer"  # comma-separated pipeline components `quantization` applies to
    attention_backend: str = ""  # a diffusers attention dispatcher backend (native, flex, flash, ...); empty: default
    offload: str = _param("none", choices=OFFLOAD_MODES)  # none, model, group (each leaf moved to the device to run)
    vae_tiling: bool = False  # the VAE decodes in overlapping tiles (bounded memory for large images and videos)

    def quantized_components(self) -> tuple:
        return tuple(c.strip() for c in self.quantize_components.split(",") if c.strip())

    @property
    def any(self) -> bool:
        return self != LeversConfig()


@dataclass(frozen=True)
class LimitsConfig:
    """What one request may ask for, checked at the Triton edge."""

    input_max: Mapping[str, float] = field(default_factory=lambda: dict(INPUT_MAX))  # `max_<input>` parameters
    input_defaults: Mapping[str, str] = field(default_factory=lambda: dict(INPUT_DEFAULTS))  # `default_<input>`
    max_queue: int = _param(64, low=1)


GROUPS = {"model": ModelConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig, "cache": CacheConfig,
          "lora": LoraConfig, "levers": LeversConfig, "limits": LimitsConfig}
PER_INPUT = ("input_max", "input_defaults")  # limits set per input (`max_<input>`, `default_<input>`), not by name
# flat config.pbtxt name -> (its group, its field)
PARAMETERS = {f.name: (group, f) for group, cls in GROUPS.items() for f in fields(cls) if f.name not in PER_INPUT}


def _group_of(name: str) -> str:
    if name in PARAMETERS:
        return PARAMETERS[name][0]
    if name in PER_INPUT:
        return "limits"
    raise ConfigError(f"unknown parameter '{name}'")


@dataclass(frozen=True)
class EngineConfig:
    """One model instance's engine settings, in groups (see docs/configuration.md)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    levers: LeversConfig = field(default_factory=LeversConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)

    @classmethod
    def of(cls, **parameters: Any) -> "EngineConfig":
        """The config with these parameters (flat names, typed values) over the defaults, validated."""
        return cls().replace(**parameters)

    @classmethod
    def from_parameters(cls, params: Mapping[str, Any]) -> "EngineConfig":
        """Parse Triton `parameters` (string values, or Triton's {"string_value": ...} dicts)."""
        values: dict[str, Any] = {}
        limits = {"input_max": dict(INPUT_MAX), "input_defaults": dict(INPUT_DEFAULTS)}
        for name, raw in params.items():
            if isinstance(raw, Mapping):
                raw = raw.get("string_value", "")
            near = difflib.get_close_matches(name, PARAMETERS, n=1, cutoff=0.85)
            if name in PARAMETERS:
                values[name] = _parse(name, PARAMETERS[name][1].type, str(raw))
            elif near:  # `max_num_seq` is a typo of `max_num_seqs`, not the limit of an input "num_seq"
                raise ConfigError(f"unknown parameter '{name}' (did you mean '{near[0]}'?)")
            elif name.startswith("max_") and len(name) > 4:  # the pipeline's declaration checks the input name
                limit = _parse(name, float, str(raw))
                limits["input_max"][name[4:]] = int(limit) if limit.is_integer() else limit
            elif name.startswith("default_") and len(name) > 8:
                limits["input_defaults"][name[8:]] = str(raw).strip()
            else:
                raise ConfigError(f"unknown parameter '{name}'; known parameters: {', '.join(sorted(PARAMETERS))}, "
                                  "max_<input>, default_<input>")
        return cls().replace(**values, **limits)

    def parameter(self, name: str) -> Any:
        """A parameter's value by its flat name (`max_num_seqs`, or `input_max` / `input_defaults`)."""
        return getattr(getattr(self, _group_of(name)), name)

    def replace(self, **parameters: Any) -> "EngineConfig":
        """This config with parameters (flat names) changed, validated."""
        changes: dict[str, dict[str, Any]] = {}
        for name, value in parameters.items():
            changes.setdefault(_group_of(name), {})[name] = value
        config = dataclasses.replace(self, **{group: dataclasses.replace(getattr(self, group), **values)
                                              for group, values in changes.items()})
        config.validate()
        return config

    def validate(self) -> None:
        for name, (_, spec) in PARAMETERS.items():  # the one check of every parameter's bound or allowed names
            value, low, choices = self.parameter(name), spec.metadata.get("low"), spec.metadata.get("choices")
            if choices is not None and value not in choices:
                raise ConfigError(f"parameter '{name}': {value!r} is not one of {', '.join(choices)}")
            if low is not None and not (math.isfinite(value) and value >= low):
                kind = "a finite number" if spec.type == "float" else "an integer"
                raise ConfigError(f"parameter '{name}': {value} must be {kind} >= {low}")
        model, scheduler, parallel = self.model, self.scheduler, self.parallel
        if model.device not in DEVICES and not re.fullmatch(r"cuda:\d+", model.device):
            raise ConfigError(f"parameter 'device': {model.device!r} is not one of {', '.join(DEVICES)}, cuda:N")
        if not 1 <= scheduler.default_priority_level <= scheduler.priority_levels:
            raise ConfigError(f"parameter 'default_priority_level': {scheduler.default_priority_level} must be in "
                              f"[1, priority_levels={scheduler.priority_levels}]")
        if parallel.devices and len(parallel.device_list()) != parallel.world_size:
            raise ConfigError(f"parameter 'devices': {parallel.devices!r} names {len(parallel.device_list())} "
                              f"device(s); this instance runs {parallel.world_size} rank(s)")
        if scheduler.max_request_cost != "auto" and not re.fullmatch(r"\d+", scheduler.max_request_cost):
            raise ConfigError(f"parameter 'max_request_cost': {scheduler.max_request_cost!r} must be auto or an "
                              "integer >= 0 (0: no limit)")
        if not self.levers.quantized_components():
            raise ConfigError("parameter 'quantize_components': names no component (default: transformer)")
        for name, value in self.limits.input_max.items():
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"parameter 'max_{name}': {value} must be a finite number >= 0")


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
