"""Tiny random-weight `Flux2KleinPipeline` preset shaped like FLUX.2 [klein] (built offline by `make models`).

The release's parts at a tiny width: double- and single-stream blocks (`Flux2Transformer2DModel`, no
guidance embedding), the FLUX.2 VAE with its batch-norm statistics over 2x2-patchified latents
(`AutoencoderKLFlux2`), and a Qwen3 causal LM whose hidden states 9, 18 and 27 are stacked into the
text features (so it has 28 layers, 36 in the release). `is_distilled` false: the base model, with CFG.
"""

from __future__ import annotations

from typing import Any, Mapping

from engine_lib.pipelines.flux.tiny import FLUX_SCHEDULER_CONFIG
from engine_lib.pipelines.tiny_parts import qwen3_tokenizer, seeded, tiny_qwen3

TEXT_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's text_encoder_out_layers

PRESETS = {"tiny": {"vae": dict(block_out_channels=[4, 8, 8], latent_channels=4, layers_per_block=1,
                                norm_num_groups=4),
                    "text_hidden": 8, "is_distilled": False, "gains": {"text_values": 10.0}}}


def build(preset: Mapping[str, Any], seed: int):
    """A random-weight `Flux2KleinPipeline` of one preset's config (float32, CPU)."""
    import torch
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel

    vae_config = preset["vae"]
    levels = len(vae_config["block_out_channels"])
    vae = seeded(seed, lambda: AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * levels, up_block_types=("UpDecoderBlock2D",) * levels,
        **vae_config))
    with torch.no_grad():  # statistics that are not the identity, so that the de-normalisation is exercised
        generator = torch.Generator().manual_seed(seed)
        vae.bn.running_mean.copy_(0.1 * torch.randn(vae.bn.running_mean.shape, generator=generator))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape, generator=generator))
    text_hidden = preset["text_hidden"]
    transformer = seeded(
        seed,
        lambda: Flux2Transformer2DModel(
            patch_size=1,
            in_channels=4 * vae_config["latent_channels"],  # 2x2-patchified latents
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=len(TEXT_LAYERS) * text_hidden,
            timestep_guidance_channels=32,
            axes_dims_rope=(4, 4, 4, 4),  # sums to attention_head_dim
            guidance_embeds=False,
        ),
    )
    # Random init leaves the tiny model nearly blind to its prompt (a new one moved the image by 0.004); scaling
    # the text values of the dual-stream blocks makes it 0.035, well past the batched tolerance (the parity suite
    # checks that a new prompt moves its image).
    with torch.no_grad():
        for block in transformer.transformer_blocks:
            block.attn.add_v_proj.weight.mul_(preset["gains"]["text_values"])
    tokenizer = qwen3_tokenizer()
    return Flux2KleinPipeline(
        # FLUX.2 [klein]'s scheduler config is FLUX.1's (dynamic shifting; the pipeline computes mu empirically)
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=tiny_qwen3(seed, tokenizer, text_hidden, max(TEXT_LAYERS) + 1, causal_lm=True),
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=preset["is_distilled"],
    )
