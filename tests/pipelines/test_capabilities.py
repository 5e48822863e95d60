"""The combination table, cell by cell: every feature a pipeline does not run and every pair of its features it
refuses is tried, at load (the registry's load, before any weights) or at admission (the engine's one validation
of a request, on the tiny model), and the refusal names both settings and the reason."""

from __future__ import annotations

import functools
import re

import pytest

from engine_lib.config import ConfigError, EngineConfig
from engine_lib.pipelines import registry
from engine_lib.pipelines.capabilities import FEATURES, REQUIRES
from engine_lib.request import InvalidInputError
from engine_lib.serving.repository import refused_pairs
from engine_lib.pipelines.tiny_models import ensure_model
from tests.helpers.parity_checks import load_tiny_adapter

NAMES = registry.names()
# The parameters that turn each load feature on (besides what it requires).
LOAD = {"request_batch": {"max_num_seqs": 2}, "step_execution": {"step_execution": True},
        "mixed_sizes": {"mixed_size_batching": True, "step_execution": True}, "cfg_parallel": {"cfg_parallel": True},
        "sequence_parallel": {"sequence_parallel_size": 2}, "tensor_parallel": {"tensor_parallel_size": 2},
        "expert_parallel": {"expert_parallel": True, "tensor_parallel_size": 2}}
# The inputs that turn each request feature on, and the setting a refusal names.
REQUEST = {"previews": {"preview_interval": 1}, "lora": {"lora_name": "toy"}, "first_block": {"cache": "first_block"},
           "taylorseer": {"cache": "taylorseer"}, "text": {"bot_task": "think"}}
SHOWN = {"request_batch": "'max_num_seqs'=2", "step_execution": "'step_execution'=true",
         "mixed_sizes": "'mixed_size_batching'=true", "cfg_parallel": "'cfg_parallel'=true",
         "sequence_parallel": "'sequence_parallel_size'=2", "tensor_parallel": "'tensor_parallel_size'=2",
         "expert_parallel": "'expert_parallel'=true", "previews": "'preview_interval'=1", "lora": "'lora_name'=toy",
         "first_block": "'cache'=first_block", "taylorseer": "'cache'=taylorseer", "image_input": "'image'"}


def config_of(name: str, *features: str) -> EngineConfig:
    values = {"pipeline": name, "model_path": str(ensure_model(name, "tiny")), "device": "cpu", "dtype": "float32"}
    for feature in features:
        values.update(LOAD[feature])
    return EngineConfig.of(**values)


@functools.lru_cache(maxsize=None)
def tiny(name: str):
    return load_tiny_adapter(name, registry.get_adapter_class(name))


def request_inputs(adapter, feature: str) -> dict:
    if feature == "text":
        declared = {spec.name for spec in adapter.inputs}
        return {"bot_task": "think"} if "bot_task" in declared else {"think": True}
    return {} if feature == "image_input" else REQUEST[feature]


def shown(adapter_cls, feature: str) -> str:
    if feature == "text":
        return "'bot_task'=think" if "bot_task" in {s.name for s in adapter_cls.inputs} else "'think'=true"
    return SHOWN[feature]


CELLS = [(name, a, b, reason) for name in NAMES
         for a, b, reason in refused_pairs(registry.get_adapter_class(name).capabilities)]
# (expert_parallel turns tensor_parallel on too: its cell is tensor_parallel's where that is not run either)
UNSUPPORTED = [(name, feature) for name in NAMES for feature in LOAD if feature != "step_execution"
               and not registry.get_adapter_class(name).capabilities.supports(feature)
               and not (feature == "expert_parallel"
                        and not registry.get_adapter_class(name).capabilities.supports("tensor_parallel"))]


@pytest.mark.parametrize("name,a,b,reason", CELLS, ids=[f"{n}-{a}-{b}" for n, a, b, _ in CELLS])
def test_a_refused_pair_is_refused_naming_both_settings(name, a, b, reason):
    cls = registry.get_adapter_class(name)
    load = [f for f in (a, b) if FEATURES[f].load]
    if len(load) == 2:
        with pytest.raises(ConfigError) as refused:
            registry.load_adapter(config_of(name, a, b))
    else:
        adapter = tiny(name)
        request = b if load else a
        other = a if load else b
        inputs = {"prompt": "a cat", **adapter.example_inputs(), **request_inputs(adapter, request)}
        if not load:
            inputs.update(request_inputs(adapter, other))
        with pytest.raises(InvalidInputError) as refused:
            adapter.input_schema(config_of(name, *load)).parse(inputs)
    message = str(refused.value)
    assert shown(cls, a) in message and shown(cls, b) in message and reason in message, message


@pytest.mark.parametrize("name,feature", UNSUPPORTED, ids=[f"{n}-{f}" for n, f in UNSUPPORTED])
def test_a_feature_the_pipeline_does_not_run_fails_its_load(name, feature):
    with pytest.raises(ConfigError, match=re.escape(f"{SHOWN[feature]}: {name} does not run {FEATURES[feature].doc}")):
        registry.load_adapter(config_of(name, feature))


@pytest.mark.parametrize("name,feature,parameter", [("qwen_image", "mixed_sizes", "mixed_size_batching"),
                                                    ("hunyuan_image3", "expert_parallel", "expert_parallel")])
def test_a_feature_without_what_it_needs_fails_the_load(name, feature, parameter):
    needed, why = REQUIRES[feature]
    with pytest.raises(ConfigError, match=re.escape(f"'{parameter}'=true needs {FEATURES[needed].doc} on ({name}): {why}")):
        registry.load_adapter(config_of(name).replace(**{parameter: True}))


def test_what_every_pipeline_runs_agrees_with_its_inputs():
    for name in NAMES:
        cls = registry.get_adapter_class(name)
        inputs = {spec.name: spec for spec in cls.inputs}
        runs = cls.capabilities.supports
        cache = inputs["cache"].choices if "cache" in inputs else ()
        assert runs("lora") == ("lora_name" in inputs), name
        assert runs("first_block") == ("first_block" in cache), name
        assert runs("taylorseer") == ("taylorseer" in cache), name
        assert runs("previews") == ("preview_interval" in inputs), name
        assert runs("image_input") == any(spec.content == "image" for spec in cls.inputs), name
        assert runs("text") == bool({"bot_task", "think", "output_modality"} & set(inputs)), name
        assert runs("mixed_sizes") == bool(getattr(cls, "step_key_skips", ())), name


def test_a_request_of_a_combination_that_runs_passes_the_check():
    adapter = tiny("qwen_image")
    config = config_of("qwen_image", "mixed_sizes")
    params = adapter.input_schema(config).parse({"prompt": "a cat", "cache": "first_block", "preview_interval": 1})
    assert params.cache == "first_block"


@pytest.mark.parametrize("name", ["qwen_image", "flux", "sd3"])
def test_a_taylorseer_request_under_mixed_size_batching_is_admitted(name):
    """Packed forwards of mixed sizes run TaylorSeer (parity: parity_checks' packed TaylorSeer test)."""
    params = tiny(name).input_schema(config_of(name, "mixed_sizes")).parse({"prompt": "a cat", "cache": "taylorseer"})
    assert params.cache == "taylorseer"


def test_qwen_image_and_flux_refuse_exactly_the_parallel_pairs_that_do_not_run():
    """CFG groups of sequence-parallel ranks (Qwen-Image), and per-row LoRAs and both step caches on the ranks, run
    (their parity: test_cfg_parallel.py, test_cfg_parallel_flux.py, test_sequence_parallel.py); packed forwards of
    mixed sizes stay in one process, and Flux runs one kind of parallelism at a time. A rule removed (a refused pair
    accepted) or added fails here, where the walk above would only lose or gain its cell."""
    kinds = {"cfg_parallel", "sequence_parallel", "tensor_parallel"}
    parallel = {(name, a, b) for name, a, b, _ in CELLS if name in ("qwen_image", "flux") and {a, b} & kinds}
    assert parallel == {("qwen_image", "mixed_sizes", "cfg_parallel"),
                        ("qwen_image", "mixed_sizes", "sequence_parallel"),
                        ("flux", "mixed_sizes", "cfg_parallel"),
                        ("flux", "mixed_sizes", "sequence_parallel"),
                        ("flux", "cfg_parallel", "sequence_parallel")}
    config = config_of("qwen_image", "cfg_parallel", "sequence_parallel")
    assert config.parallel.world_size == 4
    params = tiny("qwen_image").input_schema(config).parse({"prompt": "a cat", "negative_prompt": "blurry",
                                                            "true_cfg_scale": 4.0, "lora_name": "toy_a",
                                                            "cache": "first_block"})
    assert params.lora_name == "toy_a" and params.cache == "first_block"
