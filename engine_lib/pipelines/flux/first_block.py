"""Flux's transformer with the first-block cache decided per row group (engine_lib/pipelines/step_cache.py).

diffusers' hook walks the transformer's block lists in order, so on Flux its head is the first dual-stream
block (`transformer_blocks[0]`) and its tail the last single-stream block: a step that reuses skips the other
dual-stream blocks and every single-stream one. `cached_forward` is `FluxTransformer2DModel.forward` operation
for operation (rows of one size), `cached_packed_forward` is mixed_sizes.packed_forward (rows of different
sizes), each with its block loop handed to `step_cache.run_blocks`: the head over every row, the others over
the rows that compute, taken by index with their text stream and timestep embedding (and, packed, their own
positions). A row that computes every block gets what the plain forward gives it (bitwise for a solo request).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

from engine_lib.pipelines import step_cache
from engine_lib.pipelines.flux.mixed_sizes import FluxPacking, _double_block, _single_block, embed


def _blocks(transformer) -> list:
    """Every block in the forward's order, as the hook sees them: the dual-stream ones, then the single ones."""
    return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]


def _rows(x: torch.Tensor, index: Optional[torch.Tensor]) -> torch.Tensor:
    return x if index is None else x.index_select(0, index)


def _only(loras, rows):
    return contextlib.nullcontext() if rows is None else loras.only(rows)


@torch.inference_mode()
def cached_forward(transformer, loras, latents: torch.Tensor, timestep: torch.Tensor, guidance: Optional[torch.Tensor],
                   pooled: torch.Tensor, text_embeds: torch.Tensor, txt_ids: torch.Tensor, img_ids: torch.Tensor,
                   groups: list[step_cache.RowGroup]) -> torch.Tensor:
    """`FluxTransformer2DModel.forward` (rows of one size, one RoPE table) with per-group skips."""
    img = transformer.x_embedder(latents)
    temb, txt = embed(transformer, img, timestep, guidance, pooled, text_embeds)
    rope = transformer.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
    blocks = _blocks(transformer)
    head_txt = []

    def run(blocks, img, txt, temb):
        for block in blocks:
            txt, img = block(hidden_states=img, encoder_hidden_states=txt, temb=temb, image_rotary_emb=rope)
        return img, txt

    def head(img):
        img, out_txt = run(blocks[:1], img, txt, temb)
        head_txt.append(out_txt)
        return img

    def rest(img, rows, index):
        with _only(loras, rows):
            return run(blocks[1:], img, _rows(head_txt[0], index), _rows(temb, index))[0]

    img = step_cache.run_blocks(groups, img, head, rest)
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
    head_txt = []

    def run(blocks, img, txt, temb, packing):
        for block, forward in blocks:
            img, txt = forward(block, img, txt, temb, packing)
        return img, txt

    def head(padded):
        img, out_txt = run(blocks[:1], packing.pack(padded), txt, temb, packing)
        head_txt.append(out_txt)
        return packing.unpack(img)

    def rest(padded, rows, index):
        if rows is None:
            own, padded_rows = packing, padded
        else:
            own = FluxPacking(packing.pos_embed, packing.txt_ids, [packing.img_ids[r] for r in rows], packing.device)
            padded_rows = padded[:, :own.longest]
        # the rows alone: their LoRA plan, then their tokens' (every row: the caller's plan holds)
        with _only(loras, rows), loras.packed(own.token_rows) if rows is not None else contextlib.nullcontext():
            img, _ = run(blocks[1:], own.pack(padded_rows), _rows(head_txt[0], index), _rows(temb, index), own)
        out = own.unpack(img)
        return F.pad(out, (0, 0, 0, padded.shape[1] - out.shape[1]))

    img = step_cache.run_blocks(groups, packing.unpack(img), head, rest)
    return packing.unpack(transformer.proj_out(packing.norm_out(transformer.norm_out, packing.pack(img), temb)))
