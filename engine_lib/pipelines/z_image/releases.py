"""The Z-Image releases' component configs, and what their weights cost (docs/deployment.md's numbers).

`python -m engine_lib.pipelines.z_image.releases` builds the transformer (diffusers' defaults are the
release's config), the Qwen3-4B text encoder and FLUX.1's VAE on the meta device, counts their
parameters and prints their bfloat16 sizes. Z-Image and Z-Image-Turbo share these shapes.
"""

from __future__ import annotations

from engine_lib.pipelines.release_sizes import parameters, print_sizes

# Qwen3-4B (text_encoder/config.json): the pipeline keeps the base model, no LM head
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
FLUX1_VAE = dict(block_out_channels=(128, 256, 512, 512), latent_channels=16, layers_per_block=2,
                 down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                 use_quant_conv=False, use_post_quant_conv=False)


def sizes() -> dict[str, int]:
    """Component -> parameters."""
    from diffusers import AutoencoderKL, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    return {"transformer": parameters(ZImageTransformer2DModel),
            "text_encoder (Qwen3-4B)": parameters(lambda: Qwen3Model(Qwen3Config(**QWEN3_4B))),
            "vae (FLUX.1)": parameters(lambda: AutoencoderKL(**FLUX1_VAE))}


if __name__ == "__main__":
    print_sizes("Z-Image / Z-Image-Turbo", sizes())
