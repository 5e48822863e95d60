"""The GPU levers, each through diffusers' own machinery: compile, quantization, attention backend, offload, VAE tiling.

One step's time decides the cost of a diffusion model on a GPU (batching adds little there), so a deployer
cuts it with the same levers diffusers users have, set as config.pbtxt parameters (docs/configuration.md):

* `quantization` (+ `quantize_components`): diffusers' `PipelineQuantizationConfig` at `from_pretrained`, with
  a `TorchAoConfig` per component (torchao's int8 / fp8 / int4 weight tensors) or bitsandbytes' nf4;
* `attention_backend`: diffusers' attention dispatcher (`set_attention_backend`) on every component that has it;
* `offload`: diffusers' model CPU offload (whole components moved to the device when they run; the engine's own
  block loops, which call a transformer's parts without its `forward`, onload it first: `onload`), or group
  offloading at leaf level (every leaf module onloads itself), with streams on CUDA;
* `compile`: `compile_repeated_blocks` (regional), and with `full` the transformer's whole forward as well, with
  dynamic shapes from the first compile, so the row and token counts continuous batching changes every tick
  do not recompile; every recompilation dynamo makes is counted (`CompileCounter`);
* `vae_tiling`: the VAE's own `enable_tiling`, and LTX-2's temporal tiles (`use_framewise_decoding`).

A value the device, the installed packages or the model cannot honour fails the load naming the parameter
and the reason. Nothing here imports torch until a pipeline is loaded (config.py validates the value names).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from engine_lib.config import QUANTIZATIONS, ConfigError, LeversConfig, ParallelConfig

logger = logging.getLogger(__name__)

# attention backends this code path runs on the CPU (the others are CUDA kernels)
CPU_ATTENTION = ("native", "_native_math", "flex")
FP8_DYNAMIC_CAPABILITY = (8, 9)  # e4m3 activations need SM 8.9+ (Ada, Hopper)


# -- at from_pretrained: quantization ------------------------------------------------------------
def quantization_config(levers: LeversConfig, model_path: str, device: Any) -> Optional[Any]:
    """diffusers' `PipelineQuantizationConfig` for `levers.quantization` over `quantize_components` (None: off)."""
    if levers.quantization == "none":
        return None
    package, needs = QUANTIZATIONS[levers.quantization]
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"parameter 'quantization': {levers.quantization} needs the package {package}, which is "
                          "not installed (requirements.txt pins it)")
    if needs == "cuda" and device.type != "cuda":
        raise ConfigError(f"parameter 'quantization': {levers.quantization} runs on CUDA only; this instance runs on "
                          f"{device} (int8_weight_only, int8 and fp8_weight_only run anywhere)")
    if levers.quantization == "fp8":
        import torch

        if torch.cuda.get_device_capability(device) < FP8_DYNAMIC_CAPABILITY:
            raise ConfigError("parameter 'quantization': fp8 (dynamic e4m3 activations) needs CUDA compute "
                              f"capability 8.9+; {device} has {torch.cuda.get_device_capability(device)} "
                              "(use fp8_weight_only or int8)")
    folders = _component_folders(model_path)
    for name in levers.quantized_components():
        if name not in folders:
            raise ConfigError(f"parameter 'quantize_components': {name!r} is not a component of this checkpoint "
                              f"(it has {', '.join(sorted(folders))})")
        if "quantization_config" in folders[name]:
            raise ConfigError(f"parameter 'quantization': component {name!r} of this checkpoint is already "
                              "quantized (its config.json has a quantization_config) and loads as it is; "
                              "set quantization=none")
    from diffusers import PipelineQuantizationConfig

    return PipelineQuantizationConfig(quant_mapping={name: _component_config(levers.quantization, folders[name])
                                                     for name in levers.quantized_components()})


def _component_folders(model_path: str) -> dict[str, dict]:
    """component name -> its config.json (the folders `from_pretrained` loads; a hub id: none known)."""
    root = Path(model_path)
    folders = {}
    for config in sorted(root.glob("*/config.json")):
        folders[config.parent.name] = json.loads(config.read_text())
    return folders


def _component_config(quantization: str, component_config: dict) -> Any:
    """One component's quantization config: diffusers' for a diffusers model, transformers' for a text encoder."""
    diffusers_model = "_diffusers_version" in component_config
    if quantization == "nf4":
        if diffusers_model:
            from diffusers import BitsAndBytesConfig
        else:
            from transformers import BitsAndBytesConfig
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    import torchao.quantization as ao

    kind = {"int8_weight_only": ao.Int8WeightOnlyConfig, "int8": ao.Int8DynamicActivationInt8WeightConfig,
            "fp8_weight_only": ao.Float8WeightOnlyConfig, "fp8": ao.Float8DynamicActivationFloat8WeightConfig,
            "int4_weight_only": ao.Int4WeightOnlyConfig}[quantization]()
    if diffusers_model:
        from diffusers import TorchAoConfig
    else:
        from transformers import TorchAoConfig
    return TorchAoConfig(kind)


# -- after from_pretrained: placement, attention, compile, tiling ---------------------------------
class CompileCounter:
    """A torch.compile backend that counts what dynamo compiles, then hands the graph to the real backend.

    dynamo numbers the compilations of one frame (`CompileId.frame_compile_id`): 0 is the first, anything later
    is a recompilation after a guard failed (a shape that was not dynamic, a changed module). Runs on the engine
    thread only (where the compiled forwards run)."""

    def __init__(self, backend: str):
        from torch._dynamo.backends.registry import lookup_backend

        self._backend = lookup_backend(backend)
        self.graphs = 0
        self.recompiles = 0
        self.seconds = 0.0

    def __call__(self, graph: Any, example_inputs: list) -> Any:
        from torch._guards import CompileContext

        compile_id = CompileContext.current_compile_id()
        self.graphs += 1
        self.recompiles += int(compile_id is not None and compile_id.frame_compile_id > 0)
        start = time.perf_counter()
        try:
            return self._backend(graph, example_inputs)
        finally:
            self.seconds += time.perf_counter() - start


@dataclass
class Applied:
    """What the levers did to one loaded pipeline: its compile counter (None: not compiled)."""

    levers: LeversConfig
    compiler: Optional[CompileCounter] = None
    notes: list = field(default_factory=list)

    def compile_seconds(self) -> float:
        """Seconds dynamo spent compiling so far (tracing, guards and the backend), in this process."""
        from torch._dynamo.utils import compilation_time_metrics

        return float(sum(compilation_time_metrics.get("_compile.compile_inner", ())))

    def counters(self) -> dict[str, float]:
        """The adapter's monotone totals: recompilations (diffusion_compile_recompiles_total)."""
        if self.compiler is None:
            return {}
        return {"compile_recompiles": float(self.compiler.recompiles)}


def apply(pipe: Any, device: Any, levers: LeversConfig) -> Applied:
    """Place the loaded pipeline on `device` (or offload it), then set its attention backend, compile and
    tiling. Refuses (ConfigError naming the parameter) what this pipeline or device cannot do."""
    applied = Applied(levers)
    _place(pipe, device, levers.offload)
    if levers.attention_backend:
        _set_attention(pipe, device, levers.attention_backend)
    if levers.compile != "none":
        applied.compiler = _compile(pipe, levers)
    if levers.vae_tiling:
        vae = getattr(pipe, "vae", None)
        if vae is None or not hasattr(vae, "enable_tiling"):
            raise ConfigError("parameter 'vae_tiling': this pipeline's VAE has no tiled decode")
        vae.enable_tiling()
        if hasattr(vae, "use_framewise_decoding"):  # LTX-2's video VAE: tiles in time too, which its enable_tiling
            vae.use_framewise_decoding = True  # does not turn on (Wan's and Helios' decode one latent frame a time)
    return applied


def _place(pipe: Any, device: Any, offload: str) -> None:
    import torch

    if offload == "none":
        pipe.to(device)
    elif offload == "model":
        try:
            _offload_models(pipe, device)
        except (AttributeError, ValueError) as exc:  # no model_cpu_offload_seq, a device map
            raise ConfigError(f"parameter 'offload': model cannot offload this pipeline: {exc}") from None
        logger.info("model offloading of %s between cpu and %s", pipe.model_cpu_offload_seq, device)
    else:
        from diffusers.hooks import apply_group_offloading

        for name, module in _modules(pipe).items():
            apply_group_offloading(module, onload_device=device, offload_device=torch.device("cpu"),
                                   offload_type="leaf_level", use_stream=device.type == "cuda")
        logger.info("group offloading (leaf level) of %s between cpu and %s", ", ".join(_modules(pipe)), device)


# -- offload=model ------------------------------------------------------------------------------------
def _offload_models(pipe: Any, device: Any) -> None:
    """diffusers' model CPU offload (accelerate's hook on each component moves it to `device` when it runs), with
    one component on the device at a time (`_onload_alone`)."""
    pipe.enable_model_cpu_offload(device=device)
    owner = weakref.ref(pipe)
    for user_hook in pipe._all_hooks:
        user_hook.hook.pre_forward = functools.partial(_onload_alone, owner, user_hook.hook)


def _onload_alone(owner: Any, hook: Any, module: Any, *args: Any, **kwargs: Any) -> Any:
    """accelerate's `CpuOffload.pre_forward` (a component's forward, a VAE's `decode` through diffusers'
    `apply_forward_hook`), every other component taken off the device first: diffusers' hooks take off only the
    component before it in the pipeline's order, which keeps one on the device during a pipeline call, and the
    engine encodes a new request between two denoising steps of others. The moves run outside inference mode,
    where the engine calls it from: a quantized (torchao) weight cannot be swapped for its moved copy inside it."""
    import torch

    with torch.inference_mode(False):
        for other in getattr(owner(), "_all_hooks", ()):
            if other.model is not module:
                other.offload()
        return type(hook).pre_forward(hook, module, *args, **kwargs)


def onload(module: Any) -> None:
    """Bring a component under `offload=model` to its device before the engine calls its parts directly (the step
    cache's and packing's block loops): accelerate's hook moves a module when its `forward` is called, and this is
    what diffusers' own `apply_forward_hook` does before a VAE's `decode`. Without the hook: nothing to do."""
    hook = getattr(module, "_hf_hook", None)
    if hook is not None and hasattr(hook, "pre_forward"):
        hook.pre_forward(module)


@contextlib.contextmanager
def model_offload_paused(pipe: Any) -> Iterator[None]:
    """Under `offload=model`: the hooks off for the duration (a LoRA load), then back on the same device.
    diffusers' LoRA loader does the same itself, but puts them back on its default accelerator, which is not
    this instance's device on a CPU or with several devices."""
    device = getattr(pipe, "_offload_device", None)
    if not getattr(pipe, "_all_hooks", None) or device is None:
        yield
        return
    pipe.remove_all_hooks()
    try:
        yield
    finally:
        _offload_models(pipe, device)


def _modules(pipe: Any) -> dict[str, Any]:
    """A pipeline's torch modules by component name (our own model code: its attributes; a bare module: "model")."""
    import torch

    if isinstance(pipe, torch.nn.Module):
        return {"model": pipe}
    parts = getattr(pipe, "components", None) or vars(pipe)
    return {name: part for name, part in parts.items() if isinstance(part, torch.nn.Module)}


def _set_attention(pipe: Any, device: Any, backend: str) -> None:
    from diffusers.models.attention_dispatch import (AttentionBackendName, _AttentionBackendRegistry,
                                                     _check_attention_backend_requirements)

    names = [b.value for b in AttentionBackendName]
    if backend not in names:
        raise ConfigError(f"parameter 'attention_backend': {backend!r} is not one of diffusers' backends "
                          f"({', '.join(names)})")
    try:
        _check_attention_backend_requirements(AttentionBackendName(backend))
    except (RuntimeError, ImportError, ValueError) as exc:
        raise ConfigError(f"parameter 'attention_backend': {backend} cannot run here: {exc}") from None
    if device.type != "cuda" and backend not in CPU_ATTENTION:
        raise ConfigError(f"parameter 'attention_backend': {backend} is a CUDA kernel; this instance runs on {device} "
                          f"(on the CPU: {', '.join(CPU_ATTENTION)})")
    targets = [m for m in _modules(pipe).values() if hasattr(m, "set_attention_backend")]
    if not targets:
        raise ConfigError(f"parameter 'attention_backend': this pipeline's models do not use diffusers' attention "
                          "dispatcher")
    # diffusers' set_attention_backend also makes the backend the process-wide default, which every other model
    # of the process (a test run, several pipelines in one process) would then take; this model's processors
    # keep their own, so the default goes back to what it was.
    default, _ = _AttentionBackendRegistry.get_active_backend()
    try:
        for module in targets:
            module.set_attention_backend(backend)
    finally:
        _AttentionBackendRegistry.set_active_backend(default)


def _compile(pipe: Any, levers: LeversConfig) -> CompileCounter:
    transformer = getattr(pipe, "transformer", None)
    if transformer is None:
        raise ConfigError("parameter 'compile': this pipeline has no transformer to compile")
    # the classes diffusers declares repeated, else those of the transformer's block list (SD3 declares none)
    blocks = transformer._repeated_blocks or sorted({type(b).__name__ for b in
                                                     getattr(transformer, "transformer_blocks", ())})
    if not blocks:
        raise ConfigError(f"parameter 'compile': regional needs a transformer with repeated blocks; "
                          f"{type(transformer).__name__} has none")
    transformer._repeated_blocks = blocks
    counter = CompileCounter(levers.compile_backend)
    # dynamic=True: the rows and tokens of a step batch are symbolic from the first compile, so the shapes
    # continuous batching makes every tick reuse one graph (a batch of 1 is specialised once).
    transformer.compile_repeated_blocks(dynamic=True, backend=counter)
    if levers.compile == "full":
        # the whole forward in one graph (dynamo inlines the compiled blocks); the engine's paths that call the
        # blocks themselves (step cache, mixed sizes, the parallel ranks' split) keep the compiled blocks
        transformer.compile(dynamic=True, backend=counter)
    return counter


# -- what the weights take ---------------------------------------------------------------------------
def tensor_bytes(tensor: Any) -> int:
    """Bytes a tensor holds: a quantized tensor subclass (torchao, quanto) counts its inner tensors (int8 data,
    scales), not the size of the dense tensor it stands for."""
    inner = getattr(tensor, "__tensor_flatten__", None)
    if inner is None:
        return tensor.numel() * tensor.element_size()
    names, _ = inner()
    return sum(tensor_bytes(getattr(tensor, name)) for name in names)


def weight_bytes(pipe: Any) -> dict[str, int]:
    """component -> bytes of its parameters and buffers (diffusion_weight_bytes{component})."""
    return {name: sum(tensor_bytes(t) for t in (*module.parameters(), *module.buffers()))
            for name, module in _modules(pipe).items()}


def refuse_levers(adapter_cls: Any, levers: LeversConfig, parallel: Optional[ParallelConfig] = None) -> None:
    """A pipeline of our own model code (not loaded by a diffusers `from_pretrained`) has none of the levers. The
    parallel ranks load their model as the instance does (`adapter_cls.load` with the same config): each applies
    the levers to its own copy, but compile does not trace the sequence-parallel split."""
    if not levers.any:
        return
    changed = [name for name in LeversConfig.__dataclass_fields__
               if getattr(levers, name) != getattr(LeversConfig(), name)]
    if not hasattr(adapter_cls, "pipeline_class"):
        raise ConfigError(f"parameter '{changed[0]}': pipeline '{adapter_cls.name}' is our own model code, which "
                          "diffusers' compile, quantization, attention, offload and tiling machinery does not load")
    if levers.offload != "none" and levers.compile != "none" and levers.quantization != "none":
        raise ConfigError(f"parameter 'offload': {levers.offload} does not run with compile and quantization "
                          "together: torch.compile keeps weak references to the quantized (torchao) weights, and "
                          "torch cannot swap a weight that has one for its moved copy; offload with one of them")
    if levers.compile != "none" and parallel is not None and parallel.sequence_parallel_size > 1:
        raise ConfigError("parameter 'compile': does not run with sequence_parallel_size > 1: dynamo cannot trace "
                          "diffusers' Ulysses all_to_all (its process group is opaque to the fake tensors dynamo "
                          "traces with); compile runs with cfg_parallel alone")


def describe(adapter: Any) -> str:
    """The load log's account of the levers: what is on, the compile time so far (the warm-up's) and the bytes of
    every component's weights."""
    applied = getattr(adapter, "levers", None)
    on = [f"{name}={value}" for name, value in vars(applied.levers).items()
          if value != getattr(LeversConfig(), name)] if applied is not None else []
    text = f"levers {' '.join(on) or 'none'}"
    if applied is not None and applied.compiler is not None:
        text += (f", compiled {applied.compiler.graphs} graph(s) in {applied.compile_seconds():.1f} s, "
                 f"{applied.compiler.recompiles} recompilation(s)")
    sizes = ", ".join(f"{name} {size / 2**20:.2f} MiB" for name, size in weight_bytes(adapter.pipe).items())
    return f"{text}; weight bytes: {sizes}"
