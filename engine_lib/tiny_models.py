"""Tiny random-weight pipelines of the real diffusers classes, built offline.

Tests, demos and benchmarks need a model that loads through exactly the code
path real weights take (`DiffusionPipeline.from_pretrained(dir)`) but is small,
needs no hub access and is the same on every machine. Each builder here makes
the real pipeline class with tiny configs, seeded random weights and tokenizers
trained offline (the `tokenizers` library) on a fixed corpus, so the same seed
gives the same files byte for byte, in any process.

Pipelines and presets (registry: `available()`; add one with `@register`):

* ``qwen_image`` ``tiny`` / ``bench``, ``flux`` ``tiny``, ``sd3`` ``tiny``.
* ``tiny``: the smallest model that works; tests call it at 64x64.
* ``bench``: a transformer (6 layers, 4x64 heads) that dominates the cost the
  way a real DiT does, with the same tiny VAE and text encoder as ``tiny``.

Measured on the shared 2-core dev machine (load average about 3.5 from other
jobs; torch 2.13 CPU, float32, best of 5 calls), with
``OMP_NUM_THREADS=1 python -m engine_lib.tiny_models --pipeline P --preset S --measure [--size N --steps K]``:

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

CLI: ``python -m engine_lib.tiny_models [--pipeline qwen_image|flux|sd3|all]
[--preset tiny|bench] [--out DIR] [--force] [--measure]`` builds (if needed)
and prints the model directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent

# Bump when a builder's output changes, so stale directories under models/ are rebuilt.
FORMAT_VERSION = 1
MARKER_FILE = "tiny_model.json"

# Qwen-Image's scheduler/scheduler_config.json on the hub (Qwen/Qwen-Image).
QWEN_IMAGE_SCHEDULER_CONFIG: Dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "invert_sigmas": False,
    "stochastic_sampling": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
}

# FLUX.1's scheduler config (black-forest-labs/FLUX.1-dev).
FLUX_SCHEDULER_CONFIG: Dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}

# SD3's scheduler config (stabilityai/stable-diffusion-3-medium-diffusers).
SD3_SCHEDULER_CONFIG: Dict[str, Any] = {"num_train_timesteps": 1000, "shift": 3.0}

# The text every tokenizer is trained on: Qwen-Image's system prompt (so its chat
# template prefix is 34 tokens, as with the real tokenizer) and typical prompts.
_QWEN_SYSTEM_TEXT = (
    "system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:\nuser\nassistant\n"
)
_PROMPT_CORPUS = (
    "a photo of a cat sitting on a red chair in the sun",
    "an astronaut riding a horse on the moon, high quality, detailed",
    "dance monkey, a painting of a city at night with bright lights",
    "a bowl of fruit on a wooden table, soft light, blue background",
    "bad quality, blurry, low resolution, ugly, text, watermark",
    "a small dog running in the green grass next to a river",
    "portrait of a woman with long hair, studio lighting, 4k",
    "a red car parked in front of a white house under a cloudy sky",
)


# ---------------------------------------------------------------------------
# Registry


@dataclass(frozen=True)
class TinySpec:
    """How to build one pipeline: a builder and the configs of its presets."""

    build: Callable[[Mapping[str, Any], int], Any]  # (preset config, seed) -> DiffusionPipeline
    presets: Mapping[str, Mapping[str, Any]]


_REGISTRY: Dict[str, TinySpec] = {}


def register(name: str, presets: Mapping[str, Mapping[str, Any]]):
    """Decorator: register `build(preset_config, seed)` under a pipeline name."""

    def wrap(build: Callable[[Mapping[str, Any], int], Any]):
        _REGISTRY[name] = TinySpec(build=build, presets=presets)
        return build

    return wrap


def available() -> Dict[str, Tuple[str, ...]]:
    """Pipeline name -> its preset names."""
    return {name: tuple(spec.presets) for name, spec in _REGISTRY.items()}


def _spec(pipeline: str, preset: str) -> TinySpec:
    if pipeline not in _REGISTRY:
        raise ValueError(f"pipeline must be one of {sorted(_REGISTRY)}, got {pipeline!r}")
    spec = _REGISTRY[pipeline]
    if preset not in spec.presets:
        raise ValueError(f"preset for {pipeline!r} must be one of {sorted(spec.presets)}, got {preset!r}")
    return spec


# ---------------------------------------------------------------------------
# Public API


def build_pipeline(pipeline: str = "qwen_image", preset: str = "tiny", seed: int = 0):
    """Build a random-weight pipeline in memory (float32, CPU).

    The global torch RNG is left as it was: the build runs inside `fork_rng`.
    """
    spec = _spec(pipeline, preset)
    with torch.random.fork_rng(devices=[]):
        pipe = spec.build(spec.presets[preset], seed)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def default_model_dir(pipeline: str = "qwen_image", preset: str = "tiny") -> Path:
    """`<repo root>/models/<pipeline>-<preset>` (models/ is git-ignored)."""
    return REPO_ROOT / "models" / f"{pipeline}-{preset}"


def _marker(pipeline: str, preset: str, seed: int) -> Dict[str, Any]:
    """What a finished build records; a changed preset config makes old builds stale."""
    config = _spec(pipeline, preset).presets[preset]
    marker = {"pipeline": pipeline, "preset": preset, "seed": seed, "format_version": FORMAT_VERSION, "config": config}
    return json.loads(json.dumps(marker, sort_keys=True))  # tuples -> lists, as read back from disk


def is_complete(model_dir: Path, pipeline: str, preset: str, seed: int = 0) -> bool:
    """True when `model_dir` holds a finished build of this pipeline/preset/seed."""
    try:
        marker = json.loads((Path(model_dir) / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker == _marker(pipeline, preset, seed) and (Path(model_dir) / "model_index.json").is_file()


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
    _spec(pipeline, preset)
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
# Offline tokenizers


def _train_like(empty_tokenizer, corpus: Sequence[str], trainer) -> Dict[str, Any]:
    """Train a model with `empty_tokenizer`'s own normalizer and pre-tokenizer.

    Returns the trained model as JSON (vocab, merges), ready to pass back to the
    transformers tokenizer class. BPE training is deterministic (count ties break
    by pair id, the byte alphabet is sorted) except for ids the trainer adds for
    end-of-word suffixes; Unigram needs `_canonical_unigram_vocab`.
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(empty_tokenizer.backend_tokenizer.to_str())
    tok.train_from_iterator(list(corpus), trainer)
    return json.loads(tok.to_str())["model"]


def _canonical_unigram_vocab(model: Mapping[str, Any], special_tokens: Sequence[str]) -> list:
    """Make a trained Unigram vocab independent of the process that trained it.

    The trainer re-adds pruned single characters in hash-set order with slightly
    decreasing scores, and its float sums differ in the last digits. So: single
    characters scored below every longer piece (fallbacks) get one equal score,
    every score is rounded, and ties are sorted by piece.
    """
    pieces = [(piece, score) for piece, score in model["vocab"] if piece not in special_tokens]
    floor = min(score for piece, score in pieces if len(piece) > 1)
    pieces = [(p, floor - 1.0 if len(p) == 1 and s < floor - 1e-6 else s) for p, s in pieces]
    pieces = sorted(((p, round(s, 6)) for p, s in pieces), key=lambda item: (-item[1], item[0]))
    return [(piece, 0.0) for piece in special_tokens] + pieces


def _bpe_trainer(special_tokens: Sequence[str], vocab_size: int, **kwargs):
    from tokenizers import pre_tokenizers, trainers

    return trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        **kwargs,
    )


def qwen2_tokenizer():
    """A Qwen2Tokenizer (Qwen's split regex, byte-level BPE) trained offline.

    Qwen-Image's chat template prefix tokenizes to 34 tokens with it, as with the
    real tokenizer, because every word of the system prompt is one token.
    """
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vision = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    corpus = [_QWEN_SYSTEM_TEXT] * 4 + list(_PROMPT_CORPUS)
    model = _train_like(Qwen2Tokenizer(), corpus, _bpe_trainer(specials + vision, vocab_size=512))
    return Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=[tuple(m) for m in model["merges"]],
        errors="replace",
        model_max_length=32768,
        additional_special_tokens=specials[1:] + vision,
    )


def clip_tokenizer():
    """A CLIPTokenizer (lower-cased byte-level BPE, `</w>` word ends), model_max_length 77."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    # The trainer would add each `x</w>` it meets in hash-map order (ids differing per
    # process, and so merge tie-breaks); listing them up front fixes their ids.
    word_ends = [c + "</w>" for c in sorted(pre_tokenizers.ByteLevel.alphabet())]
    specials = ["<|startoftext|>", "<|endoftext|>"]
    trainer = _bpe_trainer(specials + word_ends, 800, end_of_word_suffix="</w>")
    model = _train_like(CLIPTokenizer(), _PROMPT_CORPUS, trainer)
    return CLIPTokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]], model_max_length=77)


def t5_tokenizer():
    """A T5Tokenizer (Unigram over Metaspace) with T5's ids: pad 0, eos 1, unk 2."""
    from tokenizers import trainers
    from transformers import T5Tokenizer

    specials = ["<pad>", "</s>", "<unk>"]
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=specials, unk_token="<unk>", show_progress=False)
    model = _train_like(T5Tokenizer(extra_ids=0), _PROMPT_CORPUS, trainer)
    return T5Tokenizer(vocab=_canonical_unigram_vocab(model, specials), extra_ids=0, model_max_length=512)


# ---------------------------------------------------------------------------
# Shared tiny components


def _seeded(seed: int, make: Callable[[], Any]) -> Any:
    """Seed torch, then build: each component's weights depend on the seed only."""
    torch.manual_seed(seed)
    return make().eval()


# Flux and SD3 share this AutoencoderKL: 3 levels, so vae_scale_factor 4.
_SD_VAE = dict(block_out_channels=[4, 8, 8], latent_channels=4, layers_per_block=1, norm_num_groups=4)


def _tiny_sd_vae(seed: int, config: Mapping[str, Any], scaling_factor: float, shift_factor: float):
    from diffusers import AutoencoderKL

    levels = len(config["block_out_channels"])
    return _seeded(
        seed,
        lambda: AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * levels,
            up_block_types=("UpDecoderBlock2D",) * levels,
            block_out_channels=tuple(config["block_out_channels"]),
            layers_per_block=config["layers_per_block"],
            latent_channels=config["latent_channels"],
            norm_num_groups=config["norm_num_groups"],
            sample_size=32,
            scaling_factor=scaling_factor,
            shift_factor=shift_factor,
            use_quant_conv=False,
            use_post_quant_conv=False,
        ),
    )


def _tiny_clip(seed: int, tokenizer, hidden_size: int, with_projection: bool):
    """CLIPTextModel(WithProjection) whose eos_token_id is the tokenizer's (pooling looks for it)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=tokenizer.model_max_length,
        projection_dim=hidden_size,
        hidden_act="gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return _seeded(seed, lambda: cls(config))


def _tiny_t5(seed: int, tokenizer, d_model: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return _seeded(seed, lambda: T5EncoderModel(config))


# ---------------------------------------------------------------------------
# Qwen-Image

# The VAE and text encoder are the same in every preset: only the transformer grows.
_QWEN_VAE = dict(base_dim=4, z_dim=4, dim_mult=[1, 1, 2], num_res_blocks=1, temperal_downsample=[False, True])
_QWEN_TEXT = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2)
_QWEN_PRESETS = {
    # attention_head_dim must equal sum(axes_dims_rope).
    "tiny": dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, axes_dims_rope=[8, 4, 4]),
    # bench: sized so that denoising dominates the cost (numbers in the module docstring).
    "bench": dict(num_layers=6, attention_head_dim=64, num_attention_heads=4, axes_dims_rope=[16, 24, 24]),
    # gpu: for benchmarks/gpu.sh on a CUDA host (unmeasured so far); built only when asked for.
    "gpu": dict(num_layers=12, attention_head_dim=128, num_attention_heads=12, axes_dims_rope=[32, 48, 48]),
}


@register(
    "qwen_image",
    presets={name: {"transformer": tr, "vae": _QWEN_VAE, "text": _QWEN_TEXT} for name, tr in _QWEN_PRESETS.items()},
)
def _build_qwen_image(preset: Mapping[str, Any], seed: int):
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    z_dim = preset["vae"]["z_dim"]
    text = preset["text"]
    tr = preset["transformer"]
    transformer = _seeded(
        seed,
        lambda: QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=4 * z_dim,  # 2x2 packed latents
            out_channels=z_dim,
            joint_attention_dim=text["hidden_size"],
            guidance_embeds=False,
            num_layers=tr["num_layers"],
            attention_head_dim=tr["attention_head_dim"],
            num_attention_heads=tr["num_attention_heads"],
            axes_dims_rope=tuple(tr["axes_dims_rope"]),
        ),
    )
    # vae_scale_factor = 2 ** len(temperal_downsample) = 4: a 64x64 image is 16x16 latents, 8x8 tokens.
    vae = _seeded(
        seed,
        lambda: AutoencoderKLQwenImage(**preset["vae"], latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim),
    )
    tokenizer = qwen2_tokenizer()
    vision_ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    config = Qwen2_5_VLConfig(
        text_config={
            **text,
            "vocab_size": len(tokenizer),
            "num_key_value_heads": text["num_attention_heads"],
            "max_position_embeddings": 2048,
            # mrope_section must sum to head_dim / 2.
            "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, head_dim // 2 - 2], "rope_theta": 1e6},
            "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": text["hidden_size"],
            "fullatt_block_indexes": [1],
        },
        vision_start_token_id=vision_ids[0],
        vision_end_token_id=vision_ids[1],
        image_token_id=vision_ids[2],
        video_token_id=vision_ids[3],
    )
    text_encoder = _seeded(seed, lambda: Qwen2_5_VLForConditionalGeneration(config))
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG)
    return QwenImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )


# ---------------------------------------------------------------------------
# Flux


@register("flux", presets={"tiny": {"vae": _SD_VAE, "clip_hidden": 16, "t5_d_model": 32}})
def _build_flux(preset: Mapping[str, Any], seed: int):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    transformer = _seeded(
        seed,
        lambda: FluxTransformer2DModel(
            patch_size=1,
            in_channels=4 * preset["vae"]["latent_channels"],  # 2x2 packed latents
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=preset["t5_d_model"],
            pooled_projection_dim=preset["clip_hidden"],  # CLIP's pooled output
            guidance_embeds=True,
            axes_dims_rope=(4, 4, 8),  # sums to attention_head_dim
        ),
    )
    tokenizer, tokenizer_2 = clip_tokenizer(), t5_tokenizer()
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER_CONFIG),
        vae=_tiny_sd_vae(seed, preset["vae"], scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=_tiny_clip(seed, tokenizer, preset["clip_hidden"], with_projection=False),
        tokenizer=tokenizer,
        text_encoder_2=_tiny_t5(seed, tokenizer_2, preset["t5_d_model"]),
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


# ---------------------------------------------------------------------------
# Stable Diffusion 3


@register("sd3", presets={"tiny": {"vae": _SD_VAE, "clip_hidden": [16, 16], "t5_d_model": 32}})
def _build_sd3(preset: Mapping[str, Any], seed: int):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    clip_1, clip_2 = preset["clip_hidden"]
    # The two CLIP hidden states are concatenated and zero-padded up to T5's width.
    assert preset["t5_d_model"] >= clip_1 + clip_2
    heads, head_dim = 2, 16
    transformer = _seeded(
        seed,
        lambda: SD3Transformer2DModel(
            sample_size=32,
            patch_size=2,
            in_channels=preset["vae"]["latent_channels"],
            out_channels=preset["vae"]["latent_channels"],
            num_layers=2,
            attention_head_dim=head_dim,
            num_attention_heads=heads,
            joint_attention_dim=preset["t5_d_model"],
            caption_projection_dim=heads * head_dim,
            pooled_projection_dim=clip_1 + clip_2,  # both CLIPs' projected pooled outputs
            pos_embed_max_size=64,  # up to 64 * patch 2 * vae 4 = 512 px
        ),
    )
    tokenizer, tokenizer_2, tokenizer_3 = clip_tokenizer(), clip_tokenizer(), t5_tokenizer()
    return StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER_CONFIG),
        vae=_tiny_sd_vae(seed, preset["vae"], scaling_factor=1.5305, shift_factor=0.0609),
        text_encoder=_tiny_clip(seed, tokenizer, clip_1, with_projection=True),
        tokenizer=tokenizer,
        text_encoder_2=_tiny_clip(seed + 1, tokenizer_2, clip_2, with_projection=True),
        tokenizer_2=tokenizer_2,
        text_encoder_3=_tiny_t5(seed, tokenizer_3, preset["t5_d_model"]),
        tokenizer_3=tokenizer_3,
        transformer=transformer,
    )


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
    parser.add_argument("--pipeline", default="qwen_image", choices=sorted(_REGISTRY) + ["all"])
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
        names = [n for n, spec in _REGISTRY.items() if args.preset in spec.presets]
    else:
        names = [args.pipeline]
    for name in names:
        try:
            path = ensure_model(name, args.preset, out_dir=args.out, force=args.force, seed=args.seed)
        except ValueError as exc:
            parser.error(str(exc))
        print(path)
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
