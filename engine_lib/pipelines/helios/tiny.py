"""Tiny random-weight `HeliosPipeline` preset (built offline by `make models`).

The configs follow diffusers' own Helios fast test (tests/pipelines/helios):
a 3-channel Wan VAE (spatial /8, temporal /4), a 2-layer transformer with the
multi-term memory patches, a tiny UMT5 encoder with the T5 tokenizer every tiny
preset shares. One chunk is 9 latent frames, 33 video frames.
"""

from __future__ import annotations

from typing import Any, Mapping

from engine_lib.pipelines.tiny_parts import seeded, t5_tokenizer, tiny_t5

PRESETS = {"tiny": {"t5_d_model": 32}}


def build(preset: Mapping[str, Any], seed: int):
    """A random-weight `HeliosPipeline` of one preset's config."""
    from diffusers import AutoencoderKLWan, HeliosPipeline, HeliosScheduler, HeliosTransformer3DModel

    vae = seeded(seed, lambda: AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                                temperal_downsample=[False, True, True]))
    transformer = seeded(
        seed,
        lambda: HeliosTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=16,
            out_channels=16,
            text_dim=preset["t5_d_model"],
            freq_dim=256,
            ffn_dim=32,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_dim=(4, 4, 4),
            has_multi_term_memory_patch=True,
            guidance_cross_attn=True,
            zero_history_timestep=True,
            is_amplify_history=False,
        ),
    )
    tokenizer = t5_tokenizer()
    return HeliosPipeline(
        tokenizer=tokenizer,
        text_encoder=tiny_t5(seed, tokenizer, preset["t5_d_model"], umt5=True),
        vae=vae,
        scheduler=HeliosScheduler(stage_range=[0, 1], stages=1, use_dynamic_shifting=True),
        transformer=transformer,
    )
