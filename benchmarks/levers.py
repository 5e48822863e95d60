"""The `levers` scenario: what each GPU lever does to one denoise step (in-process, engine_lib/pipelines/levers.py).

Qwen-Image loaded through the engine's own loader once per arm (ARMS, each with the step cache off and on); one
warm-up wave of `batch` requests (the compile happens there), then `repeats` timed waves: the time per step, the
transformer's weight bytes, and PSNR and the largest uint8 difference of every image against eager float32 without
the cache. A lever this device or the installed packages cannot run is recorded with its refusal, not raised;
docs/benchmarks.md (`levers`)."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Optional

import numpy as np

from benchmarks.offline import run_wave, sync

ARMS = {"eager": {}, "compile": {"compile": "regional"}, "int8": {"quantization": "int8_weight_only"},
        "fp8": {"quantization": "fp8"}, "compile+fp8": {"compile": "regional", "quantization": "fp8"}}
CACHES = {"": {}, " + first_block": {"cache": "first_block"}}


def arm_parameters(arm: str, device: str) -> dict:
    """The config parameters of one arm on `device` (fp8 is weight-only off CUDA; COMPILE_BACKEND overrides
    inductor, e.g. aot_eager where inductor's C++ build takes too long)."""
    params = dict(ARMS[arm])
    if params.get("quantization") == "fp8" and device != "cuda":
        params["quantization"] = "fp8_weight_only"
    if "compile" in params:
        params["compile_backend"] = os.environ.get("COMPILE_BACKEND", "inductor")
    return params


def _wave(adapter, inputs: list[dict]) -> tuple[float, list[np.ndarray]]:
    """The seconds of one wave of `inputs`, and its images."""
    start = time.perf_counter()
    outputs = run_wave(adapter, inputs)
    sync()
    return time.perf_counter() - start, [output["image"] for output in outputs]


def run(model_path: Path, device: str, dtype: str, size: int, steps: int, batch: int, repeats: int) -> dict:
    import torch

    from benchmarks.report import psnr
    from engine_lib.config import ConfigError, EngineConfig
    from engine_lib.pipelines import levers
    from engine_lib.pipelines.registry import load_adapter

    base = EngineConfig.of(model_path=str(model_path), device=device, dtype=dtype, warmup=False,
                           max_num_seqs=batch, max_loras=1)
    prompts = ["a red car", "a bowl of fruit", "a cat on a sofa", "a lighthouse at dusk"]
    inputs = [{"prompt": prompts[i % len(prompts)], "height": size, "width": size, "num_inference_steps": steps,
               "seed": i} for i in range(batch)]
    reference = load_adapter(base.replace(dtype="float32"))
    _, expected = _wave(reference, inputs)
    del reference
    if device == "cuda":
        torch.cuda.empty_cache()
    points = []
    for arm in ARMS:
        params = arm_parameters(arm, device)
        try:
            adapter = load_adapter(base.replace(**params))
        except ConfigError as exc:
            points.append({"arm": arm, "parameters": params, "refused": str(exc)})
            continue
        for cache_label, cache in CACHES.items():
            sent = [{**p, **cache} for p in inputs]
            try:
                warm_s, _ = _wave(adapter, sent)
                timed = [_wave(adapter, sent) for _ in range(repeats)]
            except Exception as exc:  # noqa: BLE001 - one arm's failure (a backend's compile) is its row
                points.append({"arm": arm + cache_label, "parameters": {**params, **cache},
                               "refused": f"failed: {type(exc).__name__}: {str(exc)[:200]}"})
                continue
            images = timed[-1][1]
            levels = max(int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max()) for a, b in zip(images, expected))
            psnrs = [psnr(a, b) for a, b in zip(images, expected)]
            points.append({"arm": arm + cache_label, "parameters": {**params, **cache}, "warmup_s": warm_s,
                           "step_s": statistics.median(s for s, _ in timed) / steps,
                           "transformer_bytes": levers.weight_bytes(adapter.pipe)["transformer"],
                           "psnr_db": min(psnrs), "max_levels": levels,
                           "recompiles": adapter.counters().get("compile_recompiles", 0.0)})
        del adapter
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"levers": {"size": size, "steps": steps, "batch": batch, "device": device, "dtype": dtype,
                       "points": points}}


# Qwen-Image at release size for gpu.sh: the release transformer (release_sizes.TRANSFORMERS), diffusers' default
# VAE (the release's), and a text encoder of the release's width but one layer (the levers change the transformer only).
RELEASE_TEXT = dict(hidden_size=3584, intermediate_size=3584, num_hidden_layers=1, num_attention_heads=28)


def release_preset() -> dict:
    """The release-size preset in the form of engine_lib/pipelines/qwen_image/tiny.py's presets."""
    from engine_lib.pipelines.release_sizes import TRANSFORMERS

    _, config = TRANSFORMERS["Qwen-Image (qwen_image)"]
    transformer = {k: config[k] for k in ("num_layers", "attention_head_dim", "num_attention_heads", "axes_dims_rope")}
    return {"transformer": transformer, "vae": {"z_dim": 16}, "text": RELEASE_TEXT,
            "gains": {"text_values": 1.0, "vae_out": 1.0}}


def release_model(out: Path, device: str, dtype: str, preset: str = "release") -> Path:
    """A random-weight Qwen-Image of `preset` ("release", or a tiny one's name for a check on the CPU) saved in
    `out` in `dtype`, built on `device` (20B float32 weights fit an H200, not a host's memory); kept once built."""
    import torch
    from diffusers import QwenImagePipeline

    from engine_lib.pipelines.qwen_image import tiny

    if (out / "done").exists():
        return out
    with torch.device(device):
        pipe = QwenImagePipeline(**tiny.components(release_preset() if preset == "release" else tiny.PRESETS[preset],
                                                   seed=0))
    pipe.to(getattr(torch, dtype)).save_pretrained(out)
    (out / "done").write_text(preset + "\n")  # last: a half-written folder is built again
    return out


def main(argv: Optional[list] = None) -> None:
    """gpu.sh's levers table: the scenario at release size on one GPU, written to --out as levers.json and .md."""
    import argparse
    import json

    from benchmarks.report import levers_tables

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--preset", default="release", help="release, or a tiny preset (a check on the CPU)")
    parser.add_argument("--model", default="models/qwen_image-release", help="where the random weights are built")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/gpu")
    args = parser.parse_args(argv)
    model = release_model(Path(args.model), args.device, args.dtype, args.preset)
    result = run(model, args.device, args.dtype, args.size, args.steps, args.batch, args.repeats)
    out, tables = Path(args.out), "\n\n".join(levers_tables(result))
    out.mkdir(parents=True, exist_ok=True)
    (out / "levers.json").write_text(json.dumps({**result, "preset": args.preset}, indent=1) + "\n")
    (out / "levers.md").write_text(tables + "\n")
    print(tables)


if __name__ == "__main__":
    main()
