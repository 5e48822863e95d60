"""What a release's weights cost, from its published configs: the helpers of each pipeline's `releases.py`
(`python -m engine_lib.pipelines.<name>.releases`, the numbers of docs/deployment.md), and what each weight format
of the GPU levers leaves of the transformers they apply to (`python -m engine_lib.pipelines.release_sizes`)."""

from __future__ import annotations


def parameters(make) -> int:
    """Parameters of the module `make()` builds, built on the meta device (no weights, no memory)."""
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in make().parameters())


def print_sizes(name: str, parts: dict[str, int]) -> None:
    """One release's total and per-component parameters and bfloat16 sizes."""
    total = sum(parts.values())
    print(f"{name}: {total / 1e9:.2f} B parameters, {2 * total / 2**30:.1f} GiB in bfloat16")
    for part, count in parts.items():
        print(f"  {part}: {count / 1e9:.3f} B, {2 * count / 2**30:.2f} GiB")


# The transformers the GPU levers apply to, as released (their config.json on the hub).
TRANSFORMERS = {
    "Qwen-Image (qwen_image)": ("QwenImageTransformer2DModel", dict(
        num_layers=60, attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584, in_channels=64,
        out_channels=16, patch_size=2, axes_dims_rope=[16, 56, 56])),
    "FLUX.1 [dev] (flux)": ("FluxTransformer2DModel", dict(
        num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
        pooled_projection_dim=768, in_channels=64, guidance_embeds=True, axes_dims_rope=[16, 56, 56])),
    "Stable Diffusion 3.5 Large (sd3)": ("SD3Transformer2DModel", dict(
        sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64, num_attention_heads=38,
        joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048, out_channels=16,
        pos_embed_max_size=192, qk_norm="rms_norm")),
}
BYTES_PER_WEIGHT = {"bfloat16": 2.0, "int8 / fp8": 1.0, "int4 / nf4": 0.5}  # Linear weights; the rest stays bf16


def weight_formats() -> list[dict]:
    """Each of TRANSFORMERS built on the meta device: its parameters, the share in Linear weights (what
    quantization converts) and its GiB under each weight format (scales, about 1/in_features, left out)."""
    import diffusers
    import torch

    rows = []
    for name, (cls, config) in TRANSFORMERS.items():
        with torch.device("meta"):
            model = getattr(diffusers, cls)(**config)
        total = sum(p.numel() for p in model.parameters())
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        rows.append({"release": name, "params_b": total / 1e9, "linear_share": linear / total,
                     **{fmt: (linear * size + (total - linear) * 2) / 2**30 for fmt, size in BYTES_PER_WEIGHT.items()}})
    return rows


if __name__ == "__main__":
    for row in weight_formats():
        print(f"{row['release']}: {row['params_b']:.2f} B parameters ({row['linear_share']:.1%} in Linear weights); "
              + ", ".join(f"{fmt} {row[fmt]:.1f} GiB" for fmt in BYTES_PER_WEIGHT))
