"""Tiny random-weight pipelines of the real diffusers classes, built offline.

Tests, demos and benchmarks need a model that loads through exactly the code
path real weights take (`DiffusionPipeline.from_pretrained(dir)`) but is small,
needs no hub access and is the same on every machine. Each pipeline's
`engine_lib/pipelines/<name>/tiny.py` builds the real pipeline class with tiny
configs, seeded random weights and tokenizers trained offline (the shared parts
are in `engine_lib/pipelines/tiny_parts.py`), so the same seed gives the same
files byte for byte, in any process. This module builds, saves and finds them
(`available()` lists every registered pipeline's presets: every pipeline has
``tiny``, the smallest model that works, which tests call at 64x64; Qwen-Image
also has ``bench`` and ``gpu``).

Measured on a 2-core CPU machine (load average about 3.5 from other
jobs; torch 2.13 CPU, float32, best of 5 calls), with
``OMP_NUM_THREADS=1 python -m engine_lib.pipelines.tiny_models --pipeline P --preset S --measure [--size N --steps K]``:

=================  =========  =====  ===========  ===========  ==========
model              size       steps  pipe() call  denoise      VAE decode
=================  =========  =====  ===========  ===========  ==========
qwen_image tiny    64x64      4      0.04 s       0.015 s      0.012 s
flux tiny          64x64      4      0.08 s       0.037 s      0.006 s
sd3 tiny (CFG)     64x64      4      0.08 s       0.037 s      0.005 s
qwen_image bench   128x128    8      1.1 s        0.92-1.05 s  0.05-0.09 s
=================  =========  =====  ===========  ===========  ==========

so a typical bench request denoises 10-20x longer than it decodes. With 2
threads on the loaded machine every number was 2-10x worse and noisier.

Known limit: with Qwen-Image's real scheduler config (``shift_terminal`` 0.02),
``num_inference_steps=1`` gives NaN sigmas: the only sigma is 1, and stretching
to the terminal value divides by ``1 - sigmas[-1]`` = 0. Adapters must ask for
>= 2 steps.

CLI: ``python -m engine_lib.pipelines.tiny_models [--pipeline <name>|all]
[--preset tiny|bench] [--out DIR] [--force] [--measure]`` builds (if needed)
and prints the model directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from engine_lib.pipelines import registry
from engine_lib.pipelines.registry import REPO_ROOT, default_model_dir

__all__ = ["REPO_ROOT", "available", "build_pipeline", "default_model_dir", "ensure_model", "is_complete"]

# Bump when a builder's output changes, so stale directories under models/ are rebuilt.
FORMAT_VERSION = 1
MARKER_FILE = "tiny_model.json"


def available() -> Dict[str, Tuple[str, ...]]:
    """Pipeline name -> its preset names."""
    return {name: tuple(registry.tiny_module(name).PRESETS) for name in registry.names()}


def _preset(pipeline: str, preset: str) -> Any:
    """The preset's config (and checks that pipeline and preset exist)."""
    if pipeline not in registry.names():
        raise ValueError(f"pipeline must be one of {registry.names()}, got {pipeline!r}")
    presets = registry.tiny_module(pipeline).PRESETS
    if preset not in presets:
        raise ValueError(f"preset for {pipeline!r} must be one of {sorted(presets)}, got {preset!r}")
    return presets[preset]


# ---------------------------------------------------------------------------
# Public API


def build_pipeline(pipeline: str = "qwen_image", preset: str = "tiny", seed: int = 0):
    """Build a random-weight pipeline in memory (float32, CPU).

    The global torch RNG is left as it was: the build runs inside `fork_rng`.
    """
    config = _preset(pipeline, preset)
    with torch.random.fork_rng(devices=[]):
        pipe = registry.tiny_module(pipeline).build(config, seed)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _marker(pipeline: str, preset: str, seed: int) -> Dict[str, Any]:
    """What a finished build records; a changed preset config makes old builds stale."""
    config = _preset(pipeline, preset)
    marker = {"pipeline": pipeline, "preset": preset, "seed": seed, "format_version": FORMAT_VERSION, "config": config}
    return json.loads(json.dumps(marker, sort_keys=True))  # tuples -> lists, as read back from disk


def is_complete(model_dir: Path, pipeline: str, preset: str, seed: int = 0) -> bool:
    """True when `model_dir` holds a finished build of this pipeline/preset/seed."""
    try:
        marker = json.loads((Path(model_dir) / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker == _marker(pipeline, preset, seed)  # written last, after every weight file


def save_pipeline(pipe, out_dir: Path, pipeline: str, preset: str, seed: int) -> None:
    """`save_pretrained` plus the marker that says the build is finished."""
    pipe.save_pretrained(str(out_dir), safe_serialization=True)
    (Path(out_dir) / MARKER_FILE).write_text(json.dumps(_marker(pipeline, preset, seed), indent=2, sort_keys=True) + "\n")


def ensure_model(
    pipeline: str = "qwen_image",
    preset: str = "tiny",
    out_dir: Optional[os.PathLike] = None,
    force: bool = False,
    seed: int = 0,
) -> Path:
    """Return a directory holding the saved pipeline, building it if missing or incomplete.

    The build is written into a temporary sibling directory and renamed into place,
    so a half-written model never looks complete, and several processes may call
    this at once (the loser of the rename race drops its copy).
    """
    _preset(pipeline, preset)
    target = Path(out_dir) if out_dir is not None else default_model_dir(pipeline, preset)
    if not force and is_complete(target, pipeline, preset, seed):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=target.parent))
    try:
        save_pipeline(build_pipeline(pipeline, preset, seed), tmp, pipeline, preset, seed)
        if target.exists():
            if not force and is_complete(target, pipeline, preset, seed):
                return target  # another process finished first
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
            os.replace(target, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if not is_complete(target, pipeline, preset, seed):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# ---------------------------------------------------------------------------
# Tiny LoRAs (engine_lib/lora.py): two per pipeline, as diffusers' save_lora_weights writes them

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # the attention projections every transformer here has
EVERY_LAYER = None  # every Linear and Conv2d of the transformer (embeddings, modulation, patch conv, output)
TOY_LORAS = {"toy_a": (1, LORA_TARGETS, 8.0), "toy_b": (2, LORA_TARGETS, 8.0),
             "toy_all": (3, EVERY_LAYER, 2.0)}  # name -> (seed, target modules, gain on lora_B: peft's random
# init is too gentle for a tiny model's image to change visibly; on every layer a smaller gain does)
LORA_RANK = 4


def ensure_loras(pipeline: str, model_dir: Path, out_dir: Optional[os.PathLike] = None) -> Path:
    """`<out_dir>/<name>.safetensors` for each of TOY_LORAS, for the model at `model_dir` (default:
    models/loras/<pipeline>); kept when present. `pipe.load_lora_weights(path)` loads them."""
    import diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    target = Path(out_dir) if out_dir is not None else registry.default_lora_dir(pipeline)
    missing = [name for name in TOY_LORAS if not (target / f"{name}.safetensors").is_file()]
    if not missing:
        return target
    adapter_cls = registry.get_adapter_class(pipeline)
    pipeline_cls = getattr(diffusers, adapter_cls.pipeline_class)
    pipe = pipeline_cls.from_pretrained(str(model_dir), **adapter_cls.from_pretrained_kwargs(str(model_dir)))
    target.mkdir(parents=True, exist_ok=True)
    every_layer = sorted(name for name, module in pipe.transformer.named_modules()
                         if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)))
    for name in missing:
        seed, targets, gain = TOY_LORAS[name]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, target_modules=targets or every_layer,
                                init_lora_weights=False)
            pipe.transformer.add_adapter(config, adapter_name=name)
        layers = get_peft_model_state_dict(pipe.transformer, adapter_name=name)
        layers = {k: v * gain if ".lora_B." in k else v for k, v in layers.items()}
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target))
        try:
            pipeline_cls.save_lora_weights(str(tmp), transformer_lora_layers=layers, weight_name=f"{name}.safetensors")
            os.replace(tmp / f"{name}.safetensors", target / f"{name}.safetensors")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# ---------------------------------------------------------------------------
# Timing (documents the presets' cost split; never asserted in tests)


def measure(pipe, height: int, width: int, steps: int, repeats: int = 5) -> Dict[str, float]:
    """Seconds (min over `repeats`) for one `pipe(...)` call and its two big parts.

    Works for any pipeline: `denoise` sums the transformer's forward calls (hooks),
    `decode` times `pipe.vae.decode` (wrapped on the instance for the duration).
    """
    import time

    spent = {"denoise": 0.0, "decode": 0.0}
    starts = []

    def add(part: str, start: float) -> None:
        spent[part] += time.perf_counter() - start

    def timed_decode(*args, **kwargs):
        start = time.perf_counter()
        try:
            return vae_decode(*args, **kwargs)
        finally:
            add("decode", start)

    vae_decode = pipe.vae.decode
    pre = pipe.transformer.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))
    post = pipe.transformer.register_forward_hook(lambda *_: add("denoise", starts.pop()))
    pipe.vae.decode = timed_decode
    best = {"call": float("inf"), "denoise": float("inf"), "decode": float("inf")}
    try:
        for i in range(repeats + 1):  # the first call warms up
            spent.update(denoise=0.0, decode=0.0)
            start = time.perf_counter()
            pipe(
                prompt="a photo of a cat",
                height=height,
                width=width,
                num_inference_steps=steps,
                generator=torch.Generator().manual_seed(0),
                output_type="np",
            )
            if i > 0:
                current = dict(spent, call=time.perf_counter() - start)
                best = {k: min(best[k], current[k]) for k in best}
    finally:
        del pipe.vae.decode
        pre.remove()
        post.remove()
    return best


# ---------------------------------------------------------------------------
# CLI


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", default="qwen_image", choices=registry.names() + ["all"])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--out", default=None, help="output directory (default: models/<pipeline>-<preset>)")
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete build exists")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--measure", action="store_true", help="also time a pipe() call (see --size, --steps)")
    parser.add_argument("--size", type=int, default=64, help="image height and width for --measure")
    parser.add_argument("--steps", type=int, default=4, help="num_inference_steps for --measure")
    args = parser.parse_args(argv)
    if args.pipeline == "all":
        if args.out is not None:
            parser.error("--out needs a single --pipeline")
        names = [n for n, presets in available().items() if args.preset in presets]
    else:
        names = [args.pipeline]
    for name in names:
        try:
            path = ensure_model(name, args.preset, out_dir=args.out, force=args.force, seed=args.seed)
        except ValueError as exc:
            parser.error(str(exc))
        print(path)
        takes_loras = any(spec.name == "lora_name" for spec in registry.get_adapter_class(name).inputs)
        if args.preset == "tiny" and args.out is None and takes_loras:
            print(ensure_loras(name, path))
        if args.measure:
            from diffusers import DiffusionPipeline
            from diffusers.utils import logging

            logging.set_verbosity_error()  # the pipelines' per-call notes about unused CFG arguments

            pipe = DiffusionPipeline.from_pretrained(str(path))
            pipe.set_progress_bar_config(disable=True)
            t = measure(pipe, args.size, args.size, args.steps)
            print(
                f"{name}-{args.preset} {args.size}x{args.size} {args.steps} steps, {torch.get_num_threads()} threads: "
                f"call {t['call']:.3f} s, denoise {t['denoise']:.3f} s, decode {t['decode']:.3f} s, "
                f"denoise/decode {t['denoise'] / max(t['decode'], 1e-9):.1f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
