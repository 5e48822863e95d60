"""Tiny random-weight `StableDiffusion3Pipeline` preset (built offline by `make models`)."""

from __future__ import annotations

from typing import Any, Dict, Mapping

from engine_lib.pipelines.tiny_parts import (SD_VAE, clip_tokenizer, seeded, t5_tokenizer, tiny_clip, tiny_sd_vae,
                                             tiny_t5)

SD3_SCHEDULER_CONFIG: Dict[str, Any] = {"num_train_timesteps": 1000, "shift": 3.0}

PRESETS = {"tiny": {"vae": SD_VAE, "clip_hidden": [16, 16], "t5_d_model": 32}}


def build(preset: Mapping[str, Any], seed: int):
    """A random-weight `StableDiffusion3Pipeline` of one preset's config."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    clip_1, clip_2 = preset["clip_hidden"]
    # The two CLIP hidden states are concatenated and zero-padded up to T5's width.
    assert preset["t5_d_model"] >= clip_1 + clip_2
    heads, head_dim = 2, 16
    transformer = seeded(
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
        vae=tiny_sd_vae(seed, preset["vae"], scaling_factor=1.5305, shift_factor=0.0609),
        text_encoder=tiny_clip(seed, tokenizer, clip_1, with_projection=True),
        tokenizer=tokenizer,
        text_encoder_2=tiny_clip(seed + 1, tokenizer_2, clip_2, with_projection=True),
        tokenizer_2=tokenizer_2,
        text_encoder_3=tiny_t5(seed, tokenizer_3, preset["t5_d_model"]),
        tokenizer_3=tokenizer_3,
        transformer=transformer,
    )
