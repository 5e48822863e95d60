"""Flux's transformer with the first-block cache decided per row group (engine_lib/pipelines/step_cache.py).

diffusers' hook walks the transformer's block lists in order, so on Flux its head is the first dual-stream
block (`transformer_blocks[0]`) and its tail the last single-stream block: a step that reuses skips the other
dual-stream blocks and every single-stream one. `cached_forward` is `FluxTransformer2DModel.forward` operation
for operation (rows of one size), `cached_packed_forward` is mixed_sizes.packed_forward (rows of different
sizes), each with its block loop handed to `step_cache.run_joint_blocks`: the head over every row, the others over
the rows that compute, taken by index with their text stream and timestep embedding (and, packed, their own
positions). A row that computes every block gets what the plain forward gives it (bitwise for a solo request).

On a sequence-parallel rank the plan splits the forward's inputs (sequence_parallel.py), which `cached_forward`
does not call: it takes the rank's share of the image and text tokens and of their ids itself, as the plan's hook
would, and the groups decide over every rank's tokens (`step_cache.should_compute`).
"""

from __future__ import annotations

from typing import Optional

import torch

from engine_lib.pipelines import sequence_parallel, step_cache, taylorseer
from engine_lib.pipelines.flux.mixed_sizes import FluxPacking, _double_block, _single_block, embed


def _blocks(transformer) -> list:
    """Every block in the forward's order, as the hook sees them: the dual-stream ones, then the single ones."""
    return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]


@torch.inference_mode()
def cached_forward(transformer, loras, latents: torch.Tensor, timestep: torch.Tensor, guidance: Optional[torch.Tensor],
                   pooled: torch.Tensor, text_embeds: torch.Tensor, txt_ids: torch.Tensor, img_ids: torch.Tensor,
                   groups: list[step_cache.RowGroup], seer=None) -> torch.Tensor:
    """`FluxTransformer2DModel.forward` (rows of one size, one RoPE table) with per-group skips."""
    share = sequence_parallel.token_share(transformer)
    if share is not None:  # the splits of the forward's hook
        latents, text_embeds = share.split(latents, 1), share.split(text_embeds, 1)
        txt_ids, img_ids = share.split(txt_ids, 0), share.split(img_ids, 0)
    img = transformer.x_embedder(latents)
    temb, txt = embed(transformer, img, timestep, guidance, pooled, text_embeds)
    rope = transformer.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
    blocks = _blocks(transformer)

    def run(which, img, txt, temb):
        for block in blocks[which]:
            txt, img = block(hidden_states=img, encoder_hidden_states=txt, temb=temb, image_rotary_emb=rope)
        return img, txt

    img = step_cache.run_joint_blocks(groups, loras, img, txt, (temb,), run, seer=seer, share=share)
    return transformer.proj_out(transformer.norm_out(img, temb))


@torch.inference_mode()
def cached_packed_forward(transformer, loras, latents: torch.Tensor, timestep: torch.Tensor,
                          guidance: Optional[torch.Tensor], pooled: torch.Tensor, text_embeds: torch.Tensor,
                          packing: FluxPacking, groups: list[step_cache.RowGroup]) -> torch.Tensor:
    """mixed_sizes.packed_forward with per-group skips: the residuals are compared in the padded row layout, each
    group over its own tokens; the rows that compute run the other blocks packed on their own (a packing of just
    their sizes, made in that tick)."""
    img = transformer.x_embedder(packing.pack(latents))
    temb, txt = embed(transformer, img, timestep, guidance, pooled, text_embeds)
    blocks = [(block, _double_block) for block in transformer.transformer_blocks] + [
        (block, _single_block) for block in transformer.single_transformer_blocks]

    def run(which, img, txt, temb, packing):
        for block, forward in blocks[which]:
            img, txt = forward(block, img, txt, temb, packing)
        return img, txt

    img = step_cache.run_joint_blocks(groups, loras, packing.unpack(img), txt, (temb,), run, packing,
                                      seer=taylorseer.running(transformer))
    return packing.unpack(transformer.proj_out(packing.norm_out(transformer.norm_out, packing.pack(img), temb)))
