"""The GPU levers (engine_lib/pipelines/levers.py) on the CPU: each loaded through the registry as the engine loads
it, each compared with the same tiny model without it, in the engine's own runner.

Compiled tests use torch.compile's `eager` backend: dynamo traces, guards and recompiles exactly as with
inductor, without inductor's C++ code generation (over a minute per graph on this CPU); the numbers of inductor
itself come from the `levers` benchmark (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import torch

from benchmarks.report import psnr
from engine_lib.config import ConfigError, EngineConfig
from engine_lib.pipelines import levers
from engine_lib.pipelines.registry import load_adapter
from engine_lib.pipelines.tiny_models import ensure_model
from tests.helpers.hostile_images import encode, rgb
from tests.helpers.parity_checks import Arrival, run_steps, solo_steps

BASE = {"prompt": "a red car", "height": 64, "width": 64, "num_inference_steps": 3, "seed": 7,
        "negative_prompt": "blurry", "true_cfg_scale": 3.7}


@functools.lru_cache(maxsize=None)
def load(pipeline: str = "qwen_image", preset: str = "tiny", **levers_on):
    """The tiny model of `pipeline` with `levers_on` (config parameters), on the CPU in float32, step mode x8."""
    config = EngineConfig.of(pipeline=pipeline, model_path=str(ensure_model(pipeline, preset)), device="cpu",
                             dtype="float32", step_execution=True, max_num_seqs=8)
    return load_adapter(config.replace(**levers_on))


def inputs(adapter, **changes) -> dict:
    """BASE with the inputs `adapter` declares (Flux has no true_cfg_scale, SD3 no true_cfg_scale either)."""
    declared = {spec.name for spec in adapter.input_specs()}
    return {k: v for k, v in {**BASE, **changes}.items() if k in declared}


def levels(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


# -- quantization ----------------------------------------------------------------------------------
def test_int8_weight_only_quantizes_every_transformer_linear_and_shrinks_its_bytes():
    plain, quantized = load(preset="bench"), load(preset="bench", quantization="int8_weight_only")
    linears = [m for m in quantized.pipe.transformer.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m.weight).__name__ == "Int8Tensor" for m in linears)
    before, after = levers.weight_bytes(plain.pipe), levers.weight_bytes(quantized.pipe)
    ratio = after["transformer"] / before["transformer"]
    print(f"bench transformer weight bytes: {before['transformer']} -> {after['transformer']} ({ratio:.3f}x)")
    assert ratio <= 0.35
    assert after["vae"] == before["vae"] and after["text_encoder"] == before["text_encoder"]  # only the transformer
    p = inputs(plain, height=96, width=96, num_inference_steps=3)
    db = psnr(solo_steps(quantized, p), solo_steps(plain, p))
    print(f"bench int8_weight_only PSNR against float32: {db:.1f} dB")
    assert db >= 30


def test_a_quantized_step_batch_equals_its_solo_runs_and_serves_a_lora():
    adapter = load(quantization="int8_weight_only")
    cases = {"a": inputs(adapter), "b": inputs(adapter, seed=8, height=96, width=96, prompt="a bowl of fruit"),
             "c": inputs(adapter, seed=9, lora_name="toy_a", lora_scale=0.6)}
    batched = run_steps(adapter, [Arrival(0, rid, p) for rid, p in cases.items()], capacity=3).images
    for rid, p in cases.items():
        assert levels(batched[rid], solo_steps(adapter, p)) <= 1, rid
    assert levels(batched["c"], solo_steps(adapter, {**cases["c"], "lora_name": ""})) > 0  # the LoRA applied


def test_what_this_cpu_or_checkpoint_cannot_quantize_is_refused_by_name():
    with pytest.raises(ConfigError, match="parameter 'quantization': fp8 runs on CUDA only"):
        load(quantization="fp8")
    with pytest.raises(ConfigError, match="parameter 'quantization': nf4 runs on CUDA only|needs the package"):
        load(quantization="nf4")
    with pytest.raises(ConfigError, match="'quantize_components': 'unet' is not a component"):
        load(quantization="int8_weight_only", quantize_components="unet")
    with pytest.raises(ConfigError, match="parameter 'quantization': 'int3' is not one of"):
        EngineConfig.from_parameters({"quantization": "int3"})
    with pytest.raises(ConfigError, match="parameter 'compile': pipeline 'bagel' is our own model code"):
        load("bagel", compile="regional")
    with pytest.raises(ConfigError, match="parameter 'compile': does not run with sequence_parallel_size > 1"):
        load(compile="regional", compile_backend="eager", sequence_parallel_size=2)
    for offload in ("model", "group"):
        with pytest.raises(ConfigError, match=f"parameter 'offload': {offload} does not run with compile and quant"):
            load(offload=offload, compile="regional", compile_backend="eager", quantization="int8_weight_only")


# -- compile -----------------------------------------------------------------------------------------
def batch_recompiles(compiled, p: dict, sizes: tuple) -> float:
    """Recompilations over step batches of 1, 3 and 8 requests `p` at each of `sizes` (after a warm-up)."""
    warm = compiled.counters()["compile_recompiles"]
    for size in sizes:
        for n in (1, 3, 8):
            run_steps(compiled, [Arrival(0, f"r{i}", {**p, "height": size, "width": size, "seed": i})
                                 for i in range(n)], capacity=8)
    return compiled.counters()["compile_recompiles"] - warm


def lora_switch_recompiles(compiled, p: dict, plans: tuple) -> float:
    """Recompilations over one step batch per plan (each request's LoRA), once toy_a and toy_b are loaded: each
    LoRA's first load changes the blocks (a recompilation), switching between them then should not."""
    run_steps(compiled, [Arrival(0, "a", {**p, "lora_name": "toy_a"}), Arrival(0, "b", {**p, "lora_name": "toy_b"})])
    before = compiled.counters()["compile_recompiles"]
    for plan in plans:
        run_steps(compiled, [Arrival(0, f"l{i}", {**p, "lora_name": name, "seed": i}) for i, name in enumerate(plan)])
    return compiled.counters()["compile_recompiles"] - before


def test_regional_compile_keeps_the_images_and_batches_of_1_3_8_at_two_sizes_recompile_at_most_twice():
    eager, compiled = load(), load(compile="regional", compile_backend="eager")
    p = inputs(eager, num_inference_steps=2, negative_prompt=None)
    assert levels(solo_steps(compiled, p), solo_steps(eager, p)) <= 2  # the warm-up: one compile
    recompiles = batch_recompiles(compiled, p, (64, 96))
    print(f"regional compile: {recompiles} recompilation(s) over batches of 1, 3, 8 at 64 and 96")
    assert recompiles <= 2
    assert re.search(r"levers compile=regional compile_backend=eager, compiled \d+ graph\(s\) in [\d.]+ s, "
                     r"\d+ recompilation\(s\); weight bytes: vae [\d.]+ MiB, text_encoder [\d.]+ MiB, "
                     r"transformer [\d.]+ MiB", levers.describe(compiled))  # the load log line's part


def test_a_lora_change_on_a_compiled_transformer_recompiles_nothing():
    """Switching LoRAs between requests recompiles nothing: their hooks run eagerly between the compiled pieces."""
    compiled = load(compile="regional", compile_backend="eager")  # the shapes test's adapter, when both run
    p = inputs(compiled, num_inference_steps=2, negative_prompt=None)
    assert lora_switch_recompiles(compiled, p, (("toy_b", "toy_a"), ("", "toy_b"), ("toy_a", ""))) == 0


@pytest.mark.parametrize("pipeline", ["flux", "sd3", "z_image", "flux2", "flux_kontext", "qwen_image_edit",
                                      "qwen_image_edit_plus"])
def test_regional_compile_of_every_flow_match_pipeline_keeps_its_images_and_hardly_recompiles(pipeline):
    """Qwen-Image's three checks above on every other flow-match pipeline: within 2 levels of eager; after the
    warm-up (the solo run), step batches of 1, 3 and 8 at two sizes recompile at most twice; switching between
    loaded LoRAs recompiles nothing."""
    eager, compiled = load(pipeline), load(pipeline, compile="regional", compile_backend="eager")
    p = inputs(eager, num_inference_steps=2, image=encode(rgb(48, 40, seed=3)), auto_resize=0)  # edits take one
    assert levels(solo_steps(compiled, p), solo_steps(eager, p)) <= 2
    assert compiled.levers.compiler.graphs >= 1
    recompiles = batch_recompiles(compiled, p, (32, 64))
    print(f"{pipeline} regional compile: {recompiles} recompilation(s) over batches of 1, 3, 8 at 32 and 64")
    assert recompiles <= 2
    assert lora_switch_recompiles(compiled, p, (("toy_b", "", "toy_a"),)) == 0


def test_full_compile_traces_the_whole_forward_and_keeps_the_images_with_the_step_cache():
    """compile=full: the transformer's forward in one graph (its output projection in it), and the step cache's
    path, which calls the blocks itself, on the compiled blocks. (With a LoRA: also within 2 levels, but its first
    load retraces the forward around the LoRA hooks, 13 graphs and about 30 s here: docs/benchmarks.md.)"""
    eager, compiled = load(), load(compile="full", compile_backend="eager")
    graphs, backend = [], compiled.levers.compiler._backend
    compiled.levers.compiler._backend = lambda gm, example: graphs.append(gm) or backend(gm, example)
    solo = inputs(eager, num_inference_steps=2, negative_prompt=None)
    assert levels(solo_steps(compiled, solo), solo_steps(eager, solo)) <= 2
    assert any("proj_out" in node.name for gm in graphs for node in gm.graph.nodes)  # the whole forward traced
    p = inputs(eager, num_inference_steps=3)
    cases = {"a": {**p, "cache": "first_block", "cache_threshold": 0.3},
             "c": {**p, "seed": 9, "prompt": "a bowl of fruit", "cache": "first_block", "cache_threshold": 0.3}}
    arrivals = [Arrival(0, rid, params) for rid, params in cases.items()]
    expected = run_steps(eager, arrivals, capacity=2).images
    got = run_steps(compiled, arrivals, capacity=2).images
    assert max(levels(got[rid], expected[rid]) for rid in cases) <= 2


def test_a_parallel_rank_loads_its_copy_of_the_model_with_the_levers():
    """What each rank process of cfg_parallel runs at its start, here in-process (spawning ranks takes tens of
    seconds; end to end, docs/benchmarks.md): the instance's config, levers included, on the rank's own copy."""
    from engine_lib.parallel import _load_pipeline_rank
    from engine_lib.pipelines.cfg_parallel import CfgRank

    path = str(ensure_model("qwen_image", "tiny"))
    config = EngineConfig.of(pipeline="qwen_image", model_path=path, device="cpu", dtype="float32", cfg_parallel=True,
                             quantization="int8_weight_only", compile="regional", compile_backend="eager")
    rank = _load_pipeline_rank(CfgRank, type(load()), path, torch.float32, config, 1, 2, torch.device("cpu"))
    plain = levers.weight_bytes(load().pipe)["transformer"]
    assert levers.weight_bytes(rank.adapter.pipe)["transformer"] <= 0.35 * plain
    assert rank.adapter.levers.compiler is not None and rank.adapter.pipe.transformer._repeated_blocks
    assert rank.report() == {"held_states": 0.0, "compile_recompiles": 0.0}  # the metrics add it to the driver's


# -- attention, offload, tiling --------------------------------------------------------------------
def test_an_attention_backend_this_cpu_has_gives_the_same_images_and_a_missing_kernel_is_refused():
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    default, _ = _AttentionBackendRegistry.get_active_backend()
    eager, native_math = load(), load(attention_backend="_native_math")
    backends = {getattr(m.processor, "_attention_backend", None) for m in native_math.pipe.transformer.modules()
                if hasattr(m, "processor")}
    assert backends == {"_native_math"}, backends  # every attention of this model runs the backend asked for
    assert _AttentionBackendRegistry.get_active_backend()[0] == default  # and no other model of the process does
    p = inputs(eager)
    assert levels(solo_steps(native_math, p), solo_steps(eager, p)) <= 1
    with pytest.raises(ConfigError, match="parameter 'attention_backend': flash cannot run here: .*flash-attn"):
        load(attention_backend="flash")
    with pytest.raises(ConfigError, match="parameter 'attention_backend': 'flash9' is not one of"):
        load(attention_backend="flash9")
    # flex over a batch whose prompts differ in length: the padded text goes through flex's mask
    flex = load(attention_backend="flex")
    cases = {"a": p, "b": inputs(eager, seed=8, height=96, width=96, prompt="a bowl of fruit on a wooden table")}
    arrivals = [Arrival(0, rid, params) for rid, params in cases.items()]
    expected, got = run_steps(eager, arrivals).images, run_steps(flex, arrivals).images
    assert max(levels(got[rid], expected[rid]) for rid in cases) <= 1


def test_group_offload_runs_end_to_end_with_parity_and_every_leaf_onloads_to_the_device():
    eager, offloaded = load(), load(offload="group")
    from diffusers.hooks import HookRegistry

    p = inputs(eager)
    assert levels(solo_steps(offloaded, p), solo_steps(eager, p)) <= 1
    lora = {**p, "lora_name": "toy_a", "lora_scale": 0.6}  # loaded after the hooks: diffusers offloads it too
    assert levels(solo_steps(offloaded, lora), solo_steps(eager, lora)) <= 1
    leaves = 0
    for name, module in levers._modules(offloaded.pipe).items():
        for leaf_name, leaf in module.named_modules():
            if any(True for _ in leaf.parameters(recurse=False)):
                hook = HookRegistry.check_if_exists_or_initialize(leaf).get_hook("group_offloading")
                assert hook is not None, f"{name}.{leaf_name} is not offloaded"
                assert hook.group.onload_device == offloaded.device, f"{name}.{leaf_name}"
                leaves += "lora_" in leaf_name
    assert leaves  # the LoRA's own layers among them


def test_model_offload_runs_end_to_end_with_parity_and_one_component_on_the_device_at_a_time(monkeypatch):
    """accelerate's hook moves a component when its `forward` is called (and takes the one before it in the
    pipeline's order off); the step cache's block loop runs the transformer's blocks without it, and the engine
    encodes a new request between two steps of another. Here each hook keeps the set of components it has put on
    the device, as on a GPU, and every leaf checks that its own component, alone, is in it when it runs."""
    from accelerate.hooks import CpuOffload

    eager, offloaded = load(), load(offload="model")
    assert isinstance(offloaded.pipe.transformer._hf_hook, CpuOffload)
    on_device, wrong, runs = set(), [], set()
    pre_forward, init_hook = CpuOffload.pre_forward, CpuOffload.init_hook

    def onload(hook, module, *args, **kwargs):
        if hook.prev_module_hook is not None:
            on_device.discard(hook.prev_module_hook.model)
        on_device.add(module)
        return pre_forward(hook, module, *args, **kwargs)

    def offload(hook, module):  # putting the hooks on, and a hook's offload()
        on_device.discard(module)
        return init_hook(hook, module)

    names = {module: name for name, module in levers._modules(offloaded.pipe).items()}

    def check(component, name):
        def hook(leaf, args):
            runs.add(name)
            if on_device != {component}:
                wrong.append((name, tuple(sorted(names[m] for m in on_device))))
        return hook

    monkeypatch.setattr(CpuOffload, "pre_forward", onload)
    monkeypatch.setattr(CpuOffload, "init_hook", offload)
    handles = [leaf.register_forward_pre_hook(check(component, name))
               for name, component in levers._modules(offloaded.pipe).items() for leaf in component.modules()
               if leaf is not component and any(True for _ in leaf.parameters(recurse=False))]
    try:
        p = inputs(eager)
        cases = {"a": p, "b": {**p, "seed": 8, "prompt": "a bowl of fruit", "cache": "first_block",
                                     "cache_threshold": 0.3},  # its blocks run directly
                 "c": {**p, "seed": 9, "lora_name": "toy_a", "lora_scale": 0.6}}  # its load takes the hooks off
        for params in cases.values():  # one after the other: each decode takes the transformer off the device
            assert levels(solo_steps(offloaded, params), solo_steps(eager, params)) <= 1
        arrivals = [Arrival(0, "a", cases["a"]), Arrival(1, "b", cases["b"])]  # b's encode between a's steps
        expected, got = run_steps(eager, arrivals).images, run_steps(offloaded, arrivals).images
        assert max(levels(got[rid], expected[rid]) for rid in ("a", "b")) <= 1
    finally:
        for handle in handles:
            handle.remove()
    assert {"text_encoder", "transformer", "vae"} <= runs
    assert not wrong, f"{len(wrong)} leaf runs with the wrong components on the device: {sorted(set(wrong))}"


@pytest.mark.parametrize("pipeline", ["flux", "sd3", "z_image", "flux2", "flux_kontext", "qwen_image_edit",
                                      "qwen_image_edit_plus", "ltx2", "wan", "wan_i2v"])
def test_model_offload_keeps_the_images_of_every_diffusers_pipeline(pipeline):
    """Each pipeline's own `model_cpu_offload_seq` (Wan 2.2's two transformers, LTX-2's audio VAE and vocoder)."""
    eager, offloaded = load(pipeline), load(pipeline, offload="model")
    p = inputs(eager, num_inference_steps=2, image=encode(rgb(48, 40, seed=3)), auto_resize=0)  # edits take one
    assert levels(solo_steps(offloaded, p), solo_steps(eager, p)) <= 1
    assert offloaded.pipe._all_hooks


@pytest.mark.parametrize("combination", [
    dict(compile="regional", offload="group"), dict(compile="full", offload="model"),
    dict(attention_backend="flex", offload="model"),
    dict(quantization="int8_weight_only", offload="model", attention_backend="_native_math", vae_tiling=True),
    dict(quantization="int8_weight_only", compile="regional", attention_backend="flex"),
], ids=lambda combination: "+".join(f"{k}={v}" for k, v in combination.items()))
def test_the_levers_compose_with_each_other_and_with_the_step_cache(combination):
    """Within 2 levels of the plain model (1 with int8 weights, which round), with and without first_block (whose
    block loop calls the transformer's blocks itself, past the forward the levers wrap)."""
    if "compile" in combination:
        combination = {**combination, "compile_backend": "eager"}
    eager, combined = load(), load(**combination)
    p = inputs(eager)
    for case in (p, {**p, "seed": 8, "cache": "first_block", "cache_threshold": 0.3}):
        assert levels(solo_steps(combined, case), solo_steps(eager, case)) <= (1 if "quantization" in combination
                                                                                else 2)


def test_vae_tiling_keeps_an_image_within_one_tile_and_decodes_a_larger_one_in_tiles():
    eager, tiled = load(), load(vae_tiling=True)
    vae = tiled.pipe.vae
    assert vae.use_tiling
    p = inputs(eager, height=128, width=128)
    assert levels(solo_steps(tiled, p), solo_steps(eager, p)) <= 1  # under the default tile: one tile, unchanged
    calls = []
    vae.tiled_decode = lambda *a, _decode=vae.tiled_decode, **k: calls.append(1) or _decode(*a, **k)
    vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=48,
                      tile_sample_stride_width=48)
    try:
        db = psnr(solo_steps(tiled, p), solo_steps(eager, p))
    finally:
        vae.enable_tiling(tile_sample_min_height=256, tile_sample_min_width=256, tile_sample_stride_height=192,
                          tile_sample_stride_width=192)  # diffusers' defaults, for the cached adapter
    print(f"vae tiling in 64-pixel tiles (stride 48) of a 128x128 image: {db:.1f} dB against one decode")
    assert calls and db >= 20  # the tiny random VAE's seams (blended over 16 pixels); a trained VAE's are finer


def test_vae_tiling_tiles_an_ltx2_video_in_time():
    """Frames past one temporal tile (16) decode in overlapping windows, so a long video's decode holds a window's
    activations; within one tile the video is unchanged."""
    eager, tiled = load("ltx2"), load("ltx2", vae_tiling=True)
    vae, calls = tiled.pipe.vae, []
    assert vae.use_tiling and vae.use_framewise_decoding
    short = inputs(eager, num_frames=9, num_inference_steps=2)
    assert levels(solo_steps(tiled, short), solo_steps(eager, short)) == 0
    vae._temporal_tiled_decode = lambda *a, _decode=vae._temporal_tiled_decode, **k: calls.append(1) or _decode(*a, **k)
    try:
        long = {**short, "num_frames": 17}
        db = psnr(solo_steps(tiled, long), solo_steps(eager, long))
    finally:
        del vae._temporal_tiled_decode
    print(f"ltx2 vae tiling in time, 17 frames: {db:.1f} dB against one decode")
    assert calls and db >= 15  # the tiny random VAE's seams between windows
