"""Tiny random-weight `FluxPipeline` preset (built offline by `make models`)."""

from __future__ import annotations

from typing import Any, Dict, Mapping

from engine_lib.pipelines.tiny_parts import (SD_VAE, clip_tokenizer, seeded, t5_tokenizer, tiny_clip, tiny_sd_vae,
                                             tiny_t5)

FLUX_SCHEDULER_CONFIG: Dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}

PRESETS = {"tiny": {"vae": SD_VAE, "clip_hidden": 16, "t5_d_model": 32}}


def build(preset: Mapping[str, Any], seed: int):
    """A random-weight `FluxPipeline` (guidance-distilled, like FLUX.1-dev) of one preset's config."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    transformer = seeded(
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
        vae=tiny_sd_vae(seed, preset["vae"], scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=tiny_clip(seed, tokenizer, preset["clip_hidden"], with_projection=False),
        tokenizer=tokenizer,
        text_encoder_2=tiny_t5(seed, tokenizer_2, preset["t5_d_model"]),
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
