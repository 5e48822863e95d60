"""Tiny random-weight `QwenImageEditPipeline` presets (built offline by `make models`).

Qwen-Image's tiny modules (qwen_image/tiny.py) with two changes the edit pipelines need:

* a VAE that downsamples 16x (Qwen-Image's tiny one does 4x): the pipelines encode every input
  image at about 1024x1024, so its condition is 32x32 = 1024 tokens instead of 16384 (and heights
  and widths are multiples of 32);
* a `Qwen2VLProcessor` (the tiny tokenizer and a Qwen2-VL image processor capped at 56x56 pixels,
  so an input image is 4 vision tokens) for the text encoder's vision tower.
"""

from __future__ import annotations

from typing import Any, Mapping

from engine_lib.pipelines.qwen_image import tiny as qwen_tiny

# 4 downsamples (vae_scale_factor 16) on one channel: torch's CPU conv3d is slow at 1024x1024 (4 channels took
# 10 s an image on the loaded 2-core machine, this one 2 s), and the mid-block attention runs on 64x64 pixels.
_EDIT_VAE = dict(base_dim=1, z_dim=4, dim_mult=[1, 2, 2, 2, 2], num_res_blocks=1,
                 temperal_downsample=[False, True, True, False])
# The vision processor's pixel bounds: a 28x28-pixel patch grid cell is one merged vision token.
_VISION_PIXELS = dict(min_pixels=28 * 28, max_pixels=56 * 56)

# Qwen-Image's gains leave this model blind to its prompt and its images (a prompt or image swap moved no pixel:
# four output tokens attend over a thousand condition tokens, and the one-channel encoder's latents barely move).
# Sharper attention (the q/k RMS-norm weights, so logits x16) and the encoder's output layer make a prompt
# swap, or a black image for a white one, move the image by about 1.0 (a new seed too).
_EDIT_GAINS = {"attention_norms": 4.0, "vae_encoder_out": 10.0}

PRESETS = {"tiny": {**qwen_tiny.PRESETS["tiny"], "vae": _EDIT_VAE, "vision": _VISION_PIXELS, "edit_gains": _EDIT_GAINS}}


def processor(tokenizer, vision: Mapping[str, int]):
    """The VL processor the edit pipelines encode a prompt and its images with."""
    from transformers import Qwen2VLImageProcessor

    from engine_lib.pipelines.qwen_image_edit.processor import image_only

    image_processor = Qwen2VLImageProcessor(size={"shortest_edge": vision["min_pixels"],
                                                  "longest_edge": vision["max_pixels"]})
    return image_only(image_processor, tokenizer)


def build(preset: Mapping[str, Any], seed: int, pipeline_class: str = "QwenImageEditPipeline"):
    """A random-weight edit pipeline of one preset's config (float32, CPU)."""
    import diffusers

    parts = qwen_tiny.components(preset, seed)
    _apply_gains(parts["transformer"], parts["vae"], preset["edit_gains"])
    return getattr(diffusers, pipeline_class)(**parts, processor=processor(parts["tokenizer"], preset["vision"]))


def _apply_gains(transformer, vae, gains: Mapping[str, float]) -> None:
    """Scale the attention's q/k norm weights and the VAE encoder's output conv (see _EDIT_GAINS for why)."""
    import torch

    with torch.no_grad():
        for block in transformer.transformer_blocks:
            for norm in (block.attn.norm_q, block.attn.norm_k, block.attn.norm_added_q, block.attn.norm_added_k):
                norm.weight.mul_(gains["attention_norms"])
        vae.encoder.conv_out.weight.mul_(gains["vae_encoder_out"])
        vae.encoder.conv_out.bias.mul_(gains["vae_encoder_out"])
