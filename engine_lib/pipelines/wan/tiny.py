"""Tiny random-weight `WanPipeline` presets (built offline; `make models` builds `tiny`).

Each is shaped like one release, at tiny widths (the configs follow diffusers' own
Wan fast tests: a 3-channel Wan VAE, /8 in space and /4 in time, 2-layer
transformers, a tiny UMT5 with the T5 tokenizer every preset shares), with the
release's scheduler (`UniPCMultistepScheduler`, flow prediction, its `flow_shift`):

* `tiny`: Wan2.2 T2V A14B: two transformers (`transformer` for high noise,
  `transformer_2` for low noise, seeded apart) switched at `boundary_ratio` 0.875,
  flow_shift 12;
* `tiny_2_1`: Wan2.1 T2V: one transformer, flow_shift 3;
* `tiny_ti2v`: Wan2.2 TI2V-5B: one transformer with per-token timesteps
  (`expand_timesteps`) over the Wan2.2 VAE's 48 channels (/16 in space, patchified),
  flow_shift 5.
"""

from __future__ import annotations

from typing import Any, Mapping

from engine_lib.pipelines.tiny_parts import seeded, t5_tokenizer, tiny_t5

PRESETS = {
    "tiny": {"t5_d_model": 32, "experts": 2, "boundary_ratio": 0.875, "flow_shift": 12.0},
    "tiny_2_1": {"t5_d_model": 32, "experts": 1, "boundary_ratio": None, "flow_shift": 3.0},
    "tiny_ti2v": {"t5_d_model": 32, "experts": 1, "boundary_ratio": None, "flow_shift": 5.0, "expand_timesteps": True},
}


def wan_vae(seed: int, wan22: bool = False):
    """The Wan2.1 VAE (16 channels, /8), or with `wan22` the Wan2.2 one (48 channels, residual, 2x2 patches: /16)."""
    from diffusers import AutoencoderKLWan

    shape = dict(base_dim=3, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
    if wan22:
        shape.update(z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
                     latents_mean=[0.0] * 48, latents_std=[1.0] * 48, scale_factor_spatial=16)
    else:
        shape.update(z_dim=16)
    return seeded(seed, lambda: AutoencoderKLWan(**shape))


def wan_transformer(seed: int, text_dim: int, in_channels: int = 16, out_channels: int = 16, **extra):
    from diffusers import WanTransformer3DModel

    return seeded(seed, lambda: WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=in_channels,
        out_channels=out_channels, text_dim=text_dim, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32, **extra))


def flow_scheduler(flow_shift: float):
    """The releases' scheduler: UniPC (multistep: each request keeps its own history) on shifted flow sigmas."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=flow_shift,
                                   num_train_timesteps=1000)


def build(preset: Mapping[str, Any], seed: int):
    """A random-weight `WanPipeline` of one preset's config."""
    from diffusers import WanPipeline

    tokenizer = t5_tokenizer()
    channels = 48 if preset.get("expand_timesteps") else 16
    d_model = preset["t5_d_model"]
    experts = [wan_transformer(seed + k, d_model, channels, channels) for k in range(preset["experts"])]
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=tiny_t5(seed, tokenizer, d_model, umt5=True),
        vae=wan_vae(seed, wan22=bool(preset.get("expand_timesteps"))),
        scheduler=flow_scheduler(preset["flow_shift"]),
        transformer=experts[0],
        transformer_2=experts[1] if len(experts) > 1 else None,
        boundary_ratio=preset["boundary_ratio"],
        expand_timesteps=bool(preset.get("expand_timesteps")),
    )
