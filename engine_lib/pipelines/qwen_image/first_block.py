"""Qwen-Image's transformer with the first-block cache decided per row group (engine_lib/pipelines/step_cache.py).

`cached_forward` is `QwenImageTransformer2DModel.forward` operation for operation (rows of one size), and
`cached_packed_forward` is mixed_sizes.packed_forward (rows of different sizes), each with its block loop
handed to `step_cache.run_joint_blocks`: the first block over every row, the others over the rows that compute,
taken by index with their text stream, text mask, timestep embedding (and, packed, their own positions).
A row that computes every block gets what the plain forward gives it (bitwise for a solo request).

On a sequence-parallel rank the plan's hooks split the first block's image and text input and the RoPE tables
(sequence_parallel.py): the blocks run the rank's share of the tokens, the first block's residual is taken
against its share of the input, and the groups decide over every rank's tokens (`step_cache.should_compute`).
"""

from __future__ import annotations

from typing import Optional

import torch

from engine_lib.pipelines import sequence_parallel, step_cache, taylorseer
from engine_lib.pipelines.qwen_image.mixed_sizes import QwenPacking, _block, embed


def _embed(transformer, *args):
    """mixed_sizes.embed, on the transformers the cache supports."""
    if transformer.zero_cond_t:
        raise NotImplementedError("the first-block cache with zero_cond_t (edit checkpoints) is not supported")
    return embed(transformer, *args)


@torch.inference_mode()
def cached_forward(transformer, loras, latents: torch.Tensor, timestep: torch.Tensor, guidance: Optional[torch.Tensor],
                   text_embeds: torch.Tensor, text_mask: Optional[torch.Tensor], img_shapes: list,
                   groups: list[step_cache.RowGroup], seer=None) -> torch.Tensor:
    """`QwenImageTransformer2DModel.forward` (rows of one size, one RoPE table) with per-group skips."""
    img = transformer.img_in(latents)
    txt, text_len, txt_mask, temb = _embed(transformer, img, timestep, guidance, text_embeds, text_mask)
    rope = transformer.pos_embed(img_shapes, max_txt_seq_len=text_len, device=img.device)
    blocks = transformer.transformer_blocks

    def run(which, img, txt, mask, temb):
        for block in blocks[which]:
            txt, img = block(hidden_states=img, encoder_hidden_states=txt, encoder_hidden_states_mask=mask,
                             temb=temb, image_rotary_emb=rope, modulate_index=None)  # (named: the plan's hooks
            # look up every input they split by name)
        return img, txt

    share = sequence_parallel.token_share(transformer)
    img = step_cache.run_joint_blocks(groups, loras, img, txt, (txt_mask, temb), run, seer=seer, share=share,
                                      head_in=None if share is None else share.split(img, 1))
    return transformer.proj_out(transformer.norm_out(img, temb))


@torch.inference_mode()
def cached_packed_forward(transformer, loras, latents: torch.Tensor, timestep: torch.Tensor,
                          guidance: Optional[torch.Tensor], text_embeds: torch.Tensor,
                          text_mask: Optional[torch.Tensor], packing: QwenPacking,
                          groups: list[step_cache.RowGroup]) -> torch.Tensor:
    """mixed_sizes.packed_forward with per-group skips: the residuals are compared in the padded row layout, each
    group over its own tokens; the rows that compute run the other blocks packed on their own (a packing of just
    their sizes, made in that tick)."""
    img = transformer.img_in(packing.pack(latents))
    txt, text_len, txt_mask, temb = _embed(transformer, img, timestep, guidance, text_embeds, text_mask)
    blocks = transformer.transformer_blocks

    def run(which, img, txt, mask, temb, packing):
        for block in blocks[which]:
            img, txt = _block(block, img, txt, mask, temb, text_len, packing)
        return img, txt

    img = step_cache.run_joint_blocks(groups, loras, packing.unpack(img), txt, (txt_mask, temb), run, packing,
                                      seer=taylorseer.running(transformer))
    return packing.unpack(transformer.proj_out(packing.norm_out(transformer.norm_out, packing.pack(img), temb)))
