"""Wan's transformer with the first-block cache decided per row group (engine_lib/pipelines/step_cache.py).

`cached_forward` is `WanTransformer3DModel.forward` operation for operation, its block loop handed to
`step_cache.run_blocks`: the head is the first block, the tail the others, as diffusers' hook splits
`blocks`. Wan's blocks carry the image stream only (the text, and Wan2.1 I2V's image tokens, enter each
block's cross-attention unchanged), so the rows that compute take their rows of the text, of the timestep
projection (per token with `expand_timesteps`) and their LoRA plan. A row that computes every block gets
what the plain forward gives it.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from engine_lib.pipelines import step_cache


@torch.inference_mode()
def cached_forward(transformer, loras, hidden_states: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                   image: Optional[torch.Tensor], groups: list[step_cache.RowGroup]) -> torch.Tensor:
    """`WanTransformer3DModel.forward` (return_dict=False's first item) with per-group skips."""
    batch_size, _, num_frames, height, width = hidden_states.shape
    p_t, p_h, p_w = transformer.config.patch_size
    rotary_emb = transformer.rope(hidden_states)
    img = transformer.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()
    seq_len = timestep.shape[1] if timestep.ndim == 2 else None
    temb, proj, text, image = transformer.condition_embedder(timestep.flatten() if seq_len else timestep, text, image,
                                                             timestep_seq_len=seq_len)
    proj = proj.unflatten(2, (6, -1)) if seq_len is not None else proj.unflatten(1, (6, -1))
    if image is not None:
        text = torch.concat([image, text], dim=1)
    blocks = transformer.blocks

    def head(img):
        return blocks[0](img, text, proj, rotary_emb)

    def rest(img, rows, index):
        own_text, own_proj = step_cache.take(text, index), step_cache.take(proj, index)
        with contextlib.nullcontext() if rows is None else loras.only(rows):
            for block in blocks[1:]:
                img = block(img, own_text, own_proj, rotary_emb)
        return img

    img = step_cache.run_blocks(groups, img, head, rest)
    if temb.ndim == 3:  # per token (Wan2.2 TI2V-5B)
        shift, scale = (transformer.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
        shift, scale = shift.squeeze(2), scale.squeeze(2)
    else:
        shift, scale = (transformer.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
    img = (transformer.norm_out(img.float()) * (1 + scale) + shift).type_as(img)
    img = transformer.proj_out(img)
    img = img.reshape(batch_size, num_frames // p_t, height // p_h, width // p_w, p_t, p_h, p_w, -1)
    img = img.permute(0, 7, 1, 4, 2, 5, 3, 6)
    return img.flatten(6, 7).flatten(4, 5).flatten(2, 3)
