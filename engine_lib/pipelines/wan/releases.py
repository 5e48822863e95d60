"""The Wan releases' component configs, and what their weights and tokens cost (docs/deployment.md's numbers).

`python -m engine_lib.pipelines.wan.releases` builds each release's transformer(s), text encoder, VAE and
image encoder from their published configs on the meta device (no weights, no memory), counts their
parameters, and prints the bfloat16 size of each and the latent tokens of the releases' default videos.
"""

from __future__ import annotations

from engine_lib.pipelines.release_sizes import parameters, print_sizes

WAN_14B = dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40, text_dim=4096)
RELEASES = {  # transformer config (x experts), VAE generation, whether a CLIP image encoder comes with it
    "Wan2.1-T2V-1.3B": (dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30,
                             text_dim=4096), 1, "2.1", False),
    "Wan2.1-T2V-14B": (WAN_14B, 1, "2.1", False),
    "Wan2.1-I2V-14B": ({**WAN_14B, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120}, 1, "2.1", True),
    "Wan2.2-T2V-A14B": (WAN_14B, 2, "2.1", False),
    "Wan2.2-I2V-A14B": ({**WAN_14B, "in_channels": 36}, 2, "2.1", False),
    "Wan2.2-TI2V-5B": (dict(num_attention_heads=24, attention_head_dim=128, ffn_dim=14336, num_layers=30,
                            text_dim=4096, in_channels=48, out_channels=48), 1, "2.2", False),
}
VAE_22 = dict(base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, in_channels=12, out_channels=12,
              patch_size=2, scale_factor_spatial=16, latents_mean=[0.0] * 48, latents_std=[1.0] * 48)
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                feed_forward_proj="gated-gelu")
CLIP_VIT_H = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                  image_size=224, patch_size=14, projection_dim=1024)


def sizes() -> dict[str, dict[str, int]]:
    """Release -> component -> parameters (the transformer line counts every expert)."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection, UMT5Config, UMT5EncoderModel

    shared = {"text_encoder (UMT5-XXL)": parameters(lambda: UMT5EncoderModel(UMT5Config(**UMT5_XXL))),
              "vae 2.1": parameters(AutoencoderKLWan), "vae 2.2": parameters(lambda: AutoencoderKLWan(**VAE_22)),
              "image_encoder (CLIP ViT-H/14)": parameters(
                  lambda: CLIPVisionModelWithProjection(CLIPVisionConfig(**CLIP_VIT_H)))}
    out = {}
    for name, (config, experts, vae, clip) in RELEASES.items():
        parts = {f"transformer x{experts}": experts * parameters(lambda: WanTransformer3DModel(**config)),
                 "text_encoder (UMT5-XXL)": shared["text_encoder (UMT5-XXL)"], f"vae {vae}": shared[f"vae {vae}"]}
        if clip:
            parts["image_encoder (CLIP ViT-H/14)"] = shared["image_encoder (CLIP ViT-H/14)"]
        out[name] = parts
    return out


def tokens(height: int, width: int, frames: int, spatial: int = 8) -> int:
    """Transformer tokens of one video: latent frames x (h / spatial / 2) x (w / spatial / 2) (2x2 patches)."""
    return ((frames - 1) // 4 + 1) * (height // spatial // 2) * (width // spatial // 2)


def main() -> None:
    for name, parts in sizes().items():
        print_sizes(name, parts)
    for h, w, spatial in ((480, 832, 8), (720, 1280, 8), (704, 1280, 16)):
        print(f"tokens of {h}x{w}x81 (VAE /{spatial}): {tokens(h, w, 81, spatial)}")


if __name__ == "__main__":
    main()
