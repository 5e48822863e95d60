"""Tiny random-weight `ZImagePipeline` preset shaped like Z-Image-Turbo (built offline by `make models`).

The release's parts at a tiny width: a single-stream DiT with noise and context refiners
(`ZImageTransformer2DModel`), FLUX.1's AutoencoderKL (scaling 0.3611, shift 0.1159), a Qwen3
language model as text encoder (its second-to-last hidden state), and Turbo's own scheduler config.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

from engine_lib.pipelines.tiny_parts import SD_VAE, qwen3_tokenizer, seeded, tiny_qwen3, tiny_sd_vae

# Tongyi-MAI/Z-Image-Turbo's scheduler/scheduler_config.json: a fixed shift of 3, no resolution-dependent mu.
Z_IMAGE_TURBO_SCHEDULER_CONFIG: Dict[str, Any] = {"num_train_timesteps": 1000, "use_dynamic_shifting": False,
                                                  "shift": 3.0}

PRESETS = {"tiny": {"vae": SD_VAE, "text_hidden": 16, "text_layers": 2, "dim": 32, "heads": 2,
                    "axes_dims": [8, 4, 4], "gains": {"caption": 8.0}}}


def build(preset: Mapping[str, Any], seed: int):
    """A random-weight `ZImagePipeline` of one preset's config (float32, CPU)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    transformer = seeded(
        seed,
        lambda: ZImageTransformer2DModel(
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=preset["vae"]["latent_channels"],
            dim=preset["dim"],
            n_layers=2,
            n_refiner_layers=1,
            n_heads=preset["heads"],
            n_kv_heads=preset["heads"],
            cap_feat_dim=preset["text_hidden"],
            axes_dims=preset["axes_dims"],  # sums to dim / heads
            axes_lens=[512, 64, 64],
        ),
    )
    # Random init leaves the tiny model nearly blind to its prompt; a larger caption projection lets a new
    # prompt move the image well past the batched tolerance (the parity suite checks that it does).
    with torch.no_grad():
        transformer.cap_embedder[1].weight.mul_(preset["gains"]["caption"])
    tokenizer = qwen3_tokenizer()
    return ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**Z_IMAGE_TURBO_SCHEDULER_CONFIG),
        vae=tiny_sd_vae(seed, preset["vae"], scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=tiny_qwen3(seed, tokenizer, preset["text_hidden"], preset["text_layers"], causal_lm=False),
        tokenizer=tokenizer,
        transformer=transformer,
    )
