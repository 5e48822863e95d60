"""What a pipeline runs and which of its features combine: one declaration per adapter, one check.

Each adapter declares `capabilities = Capabilities(...)` (base.py): the features it runs, the most
requests one step batch advances, and the pairs of its features that do not run together, each with
the reason. A feature is a load setting (a config parameter) or a request setting (an input):

    load:    request_batch, step_execution, mixed_sizes, cfg_parallel, sequence_parallel,
             tensor_parallel, expert_parallel
    request: previews, lora, first_block, taylorseer, image_input, text

`check(capabilities, config, params)` is the one check: at load (`params` None) every load feature that
is on must be declared and no two of them refused; at admission the same with the request's features
added. A refusal names both settings and the reason (a ConfigError at load, an InvalidInputError
naming the input at admission). Nothing a config or a request turns on is ignored: what the adapter
does not run is refused here. `make repository` writes the table of what combines with what from the
declarations (docs/pipelines.md).

A rule that holds for every pipeline (one kind of parallelism per instance; packed forwards only in
one process) is in `COMMON_REFUSALS`; an adapter that runs such a pair drops it with `allow`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from engine_lib.config import ConfigError
from engine_lib.request import InvalidInputError, SamplingParams

Setting = Optional[tuple[str, str]]  # (the parameter or input's name, the setting as a message shows it)


@dataclass(frozen=True)
class Feature:
    name: str
    doc: str  # the docs table's column text
    load: bool  # a config parameter (else a request input)
    setting: Callable[[Any], Setting]  # the EngineConfig (load) or SamplingParams (request) -> on: its setting


def _flag(name: str) -> Callable[[Any], Setting]:
    return lambda config: (name, f"parameter '{name}'=true") if config.parameter(name) else None


def _size(name: str) -> Callable[[Any], Setting]:
    return lambda config: ((name, f"parameter '{name}'={config.parameter(name)}") if config.parameter(name) > 1
                           else None)


def _request_batch(config) -> Setting:
    if config.scheduler.step_execution or config.scheduler.max_num_seqs <= 1:
        return None
    return "max_num_seqs", f"parameter 'max_num_seqs'={config.scheduler.max_num_seqs}"


def _input(name: str, on: Callable[[Any], bool], shown: Callable[[Any], str]) -> Callable[[Any], Setting]:
    return lambda params: (name, f"input '{name}'={shown(params.get(name))}") if on(params.get(name)) else None


def _cache(mode: str) -> Callable[[Any], Setting]:
    return _input("cache", lambda value: value == mode, str)


def _text(params) -> Setting:
    """A text phase before (or instead of) the image: HunyuanImage-3.0's bot_task, BAGEL's think / text answer."""
    if params.get("bot_task") not in (None, "image"):
        return "bot_task", f"input 'bot_task'={params.get('bot_task')}"
    if params.get("think"):
        return "think", "input 'think'=true"
    if params.get("output_modality") == "text":
        return "output_modality", "input 'output_modality'=text"
    return None


def _image(params) -> Setting:
    for name in ("image", "mask_image"):
        if params.get(name) is not None:
            return name, f"input '{name}'"
    return None


FEATURES = {f.name: f for f in (
    Feature("request_batch", "request batch", True, _request_batch),
    Feature("step_execution", "step execution", True, _flag("step_execution")),
    Feature("mixed_sizes", "mixed sizes", True, _flag("mixed_size_batching")),
    Feature("cfg_parallel", "CFG parallel", True, _flag("cfg_parallel")),
    Feature("sequence_parallel", "sequence parallel", True, _size("sequence_parallel_size")),
    Feature("tensor_parallel", "tensor parallel", True, _size("tensor_parallel_size")),
    Feature("expert_parallel", "expert parallel", True, _flag("expert_parallel")),
    Feature("previews", "previews", False, _input("preview_interval", lambda v: bool(v), str)),
    Feature("lora", "LoRA", False, _input("lora_name", lambda v: bool(v), str)),
    Feature("first_block", "first-block cache", False, _cache("first_block")),
    Feature("taylorseer", "TaylorSeer", False, _cache("taylorseer")),
    Feature("image_input", "image inputs", False, _image),
    Feature("text", "think / text", False, _text),
)}
PARALLEL = ("cfg_parallel", "sequence_parallel", "tensor_parallel")


def _pair(a: str, b: str) -> frozenset:
    assert a in FEATURES and b in FEATURES and a != b, f"unknown or equal features {a!r}, {b!r}"
    return frozenset((a, b))


# Pairs no pipeline runs unless its declaration `allow`s them (what it implements), with the reason.
COMMON_REFUSALS = {
    _pair("cfg_parallel", "sequence_parallel"): "one kind of parallelism per model instance",
    _pair("cfg_parallel", "tensor_parallel"): "one kind of parallelism per model instance",
    _pair("sequence_parallel", "tensor_parallel"): "one kind of parallelism per model instance",
    **{_pair("mixed_sizes", kind): "packed forwards of mixed sizes run in one process" for kind in PARALLEL},
}
# A feature that only does something with another one on.
REQUIRES = {"mixed_sizes": ("step_execution", "different sizes share a forward only in step execution"),
            "expert_parallel": ("tensor_parallel", "the experts spread over the tensor-parallel ranks")}


@dataclass(frozen=True)
class Capabilities:
    """One adapter's declaration (see the module docstring)."""

    features: frozenset = frozenset({"step_execution"})
    max_step_batch: int = 2**31 - 1  # requests one step batch advances (1: one at a time)
    refused: Mapping[frozenset, str] = field(default_factory=lambda: dict(COMMON_REFUSALS))

    def __post_init__(self):
        unknown = set(self.features) - set(FEATURES)
        assert not unknown, f"unknown features {sorted(unknown)}"

    def supports(self, feature: str) -> bool:
        return feature in self.features

    def with_features(self, *names: str) -> "Capabilities":
        return dataclasses.replace(self, features=self.features | set(names))

    def without(self, *names: str) -> "Capabilities":
        return dataclasses.replace(self, features=self.features - set(names))

    def refuse(self, a: str, b: str, reason: str) -> "Capabilities":
        return dataclasses.replace(self, refused={**self.refused, _pair(a, b): reason})

    def allow(self, a: str, b: str) -> "Capabilities":
        return dataclasses.replace(self, refused={k: v for k, v in self.refused.items() if k != _pair(a, b)})

    def refusal(self, a: str, b: str) -> Optional[str]:
        """Why `a` and `b` do not run together here (None: they do, or one of them is not a feature here)."""
        if not (self.supports(a) and self.supports(b)):
            return None
        return self.refused.get(_pair(a, b))


def make(*features: str, max_step_batch: int = 2**31 - 1) -> Capabilities:
    """A declaration of these features (step_execution is one to name too)."""
    return Capabilities(frozenset(features), max_step_batch)


def settings(config: Any, params: Optional[SamplingParams] = None) -> dict[str, tuple[str, str]]:
    """The features a config (and a request's params) turn on, each with its setting."""
    on = {}
    for feature in FEATURES.values():
        source = config if feature.load else params
        if source is not None and (setting := feature.setting(source)) is not None:
            on[feature.name] = setting
    return on


def check(pipeline: str, capabilities: Capabilities, config: Any, params: Optional[SamplingParams] = None) -> None:
    """The one check of what a config (at load) or a request (at admission, `params`) turns on."""
    on = settings(config, params)

    def fail(feature: str, message: str):
        name, _ = on[feature]
        if FEATURES[feature].load:
            raise ConfigError(message)
        raise InvalidInputError(name, message)

    for feature, (_, shown) in on.items():
        if not capabilities.supports(feature):
            fail(feature, f"{shown}: {pipeline} does not run {FEATURES[feature].doc}")
        needed, why = REQUIRES.get(feature, (None, ""))
        if needed is not None and needed not in on:
            fail(feature, f"{shown} needs {FEATURES[needed].doc} on ({pipeline}): {why}")
    names = list(on)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            reason = capabilities.refusal(a, b)
            if reason is not None:  # a request setting is the one named (the input), else the later parameter
                culprit = b if not FEATURES[b].load or FEATURES[a].load else a
                fail(culprit, f"{on[a][1]} and {on[b][1]} do not run together on {pipeline}: {reason}")
