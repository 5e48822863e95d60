"""Tiny random-weight `QwenImagePipeline` presets (built offline by `make models`).

* ``tiny``: the smallest model that works; tests call it at 64x64.
* ``bench``: a transformer (6 layers, 4x64 heads) that dominates the cost the
  way a real DiT does, with the same tiny VAE and text encoder as ``tiny``.
* ``gpu``: a 1.0B-parameter transformer for benchmarks/gpu.sh (built only when asked for).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

from engine_lib.pipelines.tiny_parts import qwen2_tokenizer, seeded

# Qwen-Image's scheduler/scheduler_config.json on the hub (Qwen/Qwen-Image).
QWEN_IMAGE_SCHEDULER_CONFIG: Dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "invert_sigmas": False,
    "stochastic_sampling": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
}

# The VAE and text encoder are the same in every preset: only the transformer grows.
_QWEN_VAE = dict(base_dim=4, z_dim=4, dim_mult=[1, 1, 2], num_res_blocks=1, temperal_downsample=[False, True])
_QWEN_TEXT = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2)
_QWEN_PRESETS = {
    # attention_head_dim must equal sum(axes_dims_rope).
    "tiny": dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, axes_dims_rope=[8, 4, 4]),
    # bench: sized so that denoising dominates the cost (numbers in engine_lib/pipelines/tiny_models.py).
    "bench": dict(num_layers=6, attention_head_dim=64, num_attention_heads=4, axes_dims_rope=[16, 24, 24]),
    # gpu: for benchmarks/gpu.sh on a CUDA host (unmeasured so far); built only when asked for.
    "gpu": dict(num_layers=12, attention_head_dim=128, num_attention_heads=12, axes_dims_rope=[32, 48, 48]),
}


# Random init leaves a tiny Qwen-Image almost blind to its prompt and its VAE almost gray: swapping the whole prompt
# moved a 64x64 image by 1e-3 (a new seed by 0.07), so a bug that gave one row another row's text moved images by
# less than the tests' float bound (1e-4). Scaling the text values in every attention block and the VAE's output
# layer makes a prompt swap move the image by about 0.04 (a new seed by 0.4), which the parity suite checks
# (`test_changing_one_request_changes_only_its_image`). Weights only: speed is unchanged.
_QWEN_GAINS = {"text_values": 10.0, "vae_out": 6.0}

PRESETS = {name: {"transformer": tr, "vae": _QWEN_VAE, "text": _QWEN_TEXT, "gains": _QWEN_GAINS}
           for name, tr in _QWEN_PRESETS.items()}


def build(preset: Mapping[str, Any], seed: int):
    """A random-weight `QwenImagePipeline` of one preset's config (float32, CPU)."""
    from diffusers import QwenImagePipeline

    return QwenImagePipeline(**components(preset, seed))


def components(preset: Mapping[str, Any], seed: int) -> Dict[str, Any]:
    """The random-weight modules, tokenizer and scheduler of one preset (the edit pipelines add a processor)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    z_dim = preset["vae"]["z_dim"]
    text = preset["text"]
    tr = preset["transformer"]
    transformer = seeded(
        seed,
        lambda: QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=4 * z_dim,  # 2x2 packed latents
            out_channels=z_dim,
            joint_attention_dim=text["hidden_size"],
            guidance_embeds=False,
            num_layers=tr["num_layers"],
            attention_head_dim=tr["attention_head_dim"],
            num_attention_heads=tr["num_attention_heads"],
            axes_dims_rope=tuple(tr["axes_dims_rope"]),
        ),
    )
    # vae_scale_factor = 2 ** len(temperal_downsample) = 4: a 64x64 image is 16x16 latents, 8x8 tokens.
    vae = seeded(
        seed,
        lambda: AutoencoderKLQwenImage(**preset["vae"], latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim),
    )
    tokenizer = qwen2_tokenizer()
    vision_ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    config = Qwen2_5_VLConfig(
        text_config={
            **text,
            "vocab_size": len(tokenizer),
            "num_key_value_heads": text["num_attention_heads"],
            "max_position_embeddings": 2048,
            # mrope_section must sum to head_dim / 2.
            "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, head_dim // 2 - 2], "rope_theta": 1e6},
            "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": text["hidden_size"],
            "fullatt_block_indexes": [1],
        },
        vision_start_token_id=vision_ids[0],
        vision_end_token_id=vision_ids[1],
        image_token_id=vision_ids[2],
        video_token_id=vision_ids[3],
    )
    text_encoder = seeded(seed, lambda: Qwen2_5_VLForConditionalGeneration(config))
    _apply_gains(transformer, vae, preset["gains"])
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG)
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


def _apply_gains(transformer, vae, gains: Mapping[str, float]) -> None:
    """Scale the text value projections and the VAE's output conv (see _QWEN_GAINS for why)."""
    import torch

    scaled = [(block.attn.add_v_proj, gains["text_values"]) for block in transformer.transformer_blocks]
    with torch.no_grad():
        for layer, factor in scaled + [(vae.decoder.conv_out, gains["vae_out"])]:
            layer.weight.mul_(factor)
            layer.bias.mul_(factor)
