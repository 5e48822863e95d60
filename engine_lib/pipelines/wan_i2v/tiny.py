"""Tiny random-weight `WanImageToVideoPipeline` presets (built offline; `make models` builds `tiny`).

The text encoder, VAE and scheduler are the text-to-video presets' (engine_lib/pipelines/wan/tiny.py);
each preset is shaped like one image-to-video release:

* `tiny`: Wan2.2 I2V A14B: two experts taking 36 channels (16 noise, 4 mask, 16 image latents),
  `boundary_ratio` 0.9, flow_shift 5, no image encoder;
* `tiny_2_1`: Wan2.1 I2V: one transformer that also attends to CLIP image tokens (`image_dim`), with
  a tiny `CLIPVisionModel` and its `CLIPImageProcessor`;
* `tiny_ti2v`: Wan2.2 TI2V-5B: the image's latents replace the first latent frame, whose tokens run at
  timestep 0 (`expand_timesteps`), over the Wan2.2 VAE's 48 channels.
"""

from __future__ import annotations

from typing import Any, Mapping

from engine_lib.pipelines.tiny_parts import seeded, t5_tokenizer, tiny_t5
from engine_lib.pipelines.wan.tiny import flow_scheduler, wan_transformer, wan_vae

CLIP_HIDDEN = 4
PRESETS = {
    "tiny": {"t5_d_model": 32, "experts": 2, "boundary_ratio": 0.9, "flow_shift": 5.0},
    "tiny_2_1": {"t5_d_model": 32, "experts": 1, "boundary_ratio": None, "flow_shift": 3.0, "image_encoder": True},
    "tiny_ti2v": {"t5_d_model": 32, "experts": 1, "boundary_ratio": None, "flow_shift": 5.0, "expand_timesteps": True},
}


def clip_image_encoder(seed: int):
    """A 2-layer `CLIPVisionModel` on 32x32 images and its processor (the pipeline reads hidden_states[-2])."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(hidden_size=CLIP_HIDDEN, projection_dim=CLIP_HIDDEN, num_hidden_layers=2,
                              num_attention_heads=2, image_size=32, intermediate_size=16, patch_size=8)
    return seeded(seed, lambda: CLIPVisionModel(config)), CLIPImageProcessor(crop_size=32, size=32)


def build(preset: Mapping[str, Any], seed: int):
    """A random-weight `WanImageToVideoPipeline` of one preset's config."""
    from diffusers import WanImageToVideoPipeline

    tokenizer = t5_tokenizer()
    expand = bool(preset.get("expand_timesteps"))
    d_model = preset["t5_d_model"]
    channels = (48, 48) if expand else (36, 16)  # in, out: noise + mask + image latents in, noise out
    extra = {}
    image_encoder = image_processor = None
    if preset.get("image_encoder"):
        image_encoder, image_processor = clip_image_encoder(seed)
        extra = {"image_dim": CLIP_HIDDEN, "added_kv_proj_dim": 24}  # 24: the transformer's inner dim (2 x 12)
    experts = [wan_transformer(seed + k, d_model, *channels, **extra) for k in range(preset["experts"])]
    return WanImageToVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=tiny_t5(seed, tokenizer, d_model, umt5=True),
        vae=wan_vae(seed, wan22=expand),
        scheduler=flow_scheduler(preset["flow_shift"]),
        image_processor=image_processor,
        image_encoder=image_encoder,
        transformer=experts[0],
        transformer_2=experts[1] if len(experts) > 1 else None,
        boundary_ratio=preset["boundary_ratio"],
        expand_timesteps=expand,
    )
