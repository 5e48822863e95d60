"""Flux requests of different image sizes in one denoise forward, packed (beyond diffusers).

diffusers' transformer builds one RoPE table for the whole batch from 2-D
`txt_ids`/`img_ids`. A ragged batch runs `packed_forward` instead (the packing:
engine_lib/pipelines/packing.py): the image stream packed into one sequence, each
token modulated by its own row's timestep embedding and rotated by the table of its
own row's `img_ids` (Flux's text ids are zeros, so every row's text shares one
table), the joint attention once per group of rows of one image token count. In the
single-stream blocks, where diffusers joins [text; image] into one sequence per row,
the text rows and the packed image tokens go through the same layers side by side and
meet only in the attention. A batch of one size runs diffusers' own forward, so solo
requests stay bitwise the pipeline's; this module mirrors `FluxTransformer2DModel.forward`,
its two block kinds and `FluxAttnProcessor` operation for operation otherwise.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from diffusers.models.embeddings import apply_rotary_emb

from engine_lib.pipelines.packing import Packing
from engine_lib.pipelines.taylorseer import packed_attention


class FluxPacking(Packing):
    """The packing with Flux's rotary tables: the text's (`txt_ids`, shared by every row) and each row's
    image table of its own `img_ids`, in packed order (`FluxPosEmbed` is per position, so a table of the
    packed ids is each row's own table)."""

    def __init__(self, pos_embed, txt_ids: torch.Tensor, img_ids: list[torch.Tensor], device: torch.device) -> None:
        super().__init__([ids.shape[0] for ids in img_ids], device)
        self.pos_embed, self.txt_ids, self.img_ids = pos_embed, txt_ids, list(img_ids)
        self.txt_rope = pos_embed(txt_ids)
        self.img_rope = pos_embed(torch.cat([self.img_ids[r] for r in self.order]))

    def _repeat(self, times: int) -> "FluxPacking":
        return FluxPacking(self.pos_embed, self.txt_ids, self.img_ids * times, self.device)

    def subset(self, rows: list[int]) -> "FluxPacking":
        """The packing of just the rows `rows`, in that order."""
        return FluxPacking(self.pos_embed, self.txt_ids, [self.img_ids[r] for r in rows], self.device)


def _attention(attn, img: torch.Tensor, txt: torch.Tensor, packing: FluxPacking) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention module `attn` on a packed image stream (under TaylorSeer: taylorseer.packed_attention)."""
    return packed_attention(attn, functools.partial(_joint, attn), packing, img, txt, joined=attn.pre_only)


def _joint(attn, packing: FluxPacking, img: torch.Tensor, txt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`FluxAttnProcessor` with a packed image stream: projections per real token, the joint attention once
    per group. A double-stream block projects the text with its own `add_*_proj` layers; a single-stream
    block (`pre_only`) with the image's."""
    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (-1, attn.head_dim))

    img_q, img_k, img_v = heads(attn.to_q(img)), heads(attn.to_k(img)), heads(attn.to_v(img))
    img_q, img_k = attn.norm_q(img_q), attn.norm_k(img_k)
    if attn.added_kv_proj_dim is not None:
        txt_q, txt_k, txt_v = heads(attn.add_q_proj(txt)), heads(attn.add_k_proj(txt)), heads(attn.add_v_proj(txt))
        txt_q, txt_k = attn.norm_added_q(txt_q), attn.norm_added_k(txt_k)
    else:
        txt_q, txt_k, txt_v = heads(attn.to_q(txt)), heads(attn.to_k(txt)), heads(attn.to_v(txt))
        txt_q, txt_k = attn.norm_q(txt_q), attn.norm_k(txt_k)
    img_q = apply_rotary_emb(img_q, packing.img_rope, sequence_dim=1)
    img_k = apply_rotary_emb(img_k, packing.img_rope, sequence_dim=1)
    txt_q = apply_rotary_emb(txt_q, packing.txt_rope, sequence_dim=1)
    txt_k = apply_rotary_emb(txt_k, packing.txt_rope, sequence_dim=1)
    txt_out, img_out = packing.attend(attn, txt_q, txt_k, txt_v, img_q, img_k, img_v)
    if attn.pre_only:
        return img_out, txt_out
    return attn.to_out[1](attn.to_out[0](img_out.contiguous())), attn.to_add_out(txt_out.contiguous())


def _double_block(block, img: torch.Tensor, txt: torch.Tensor, temb: torch.Tensor,
                  packing: FluxPacking) -> tuple[torch.Tensor, torch.Tensor]:
    """`FluxTransformerBlock.forward` on a packed image stream (img [1, T, D]; txt [R, L, D]; temb [R, D])."""
    norm1 = block.norm1  # AdaLayerNormZero with its six parameters per token
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = packing.per_token(
        norm1.linear(norm1.silu(temb))).chunk(6, dim=-1)
    norm_img = norm1.norm(img) * (1 + scale_msa) + shift_msa
    norm_txt, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(txt, emb=temb)
    img_attn, txt_attn = _attention(block.attn, norm_img, norm_txt, packing)

    img = img + gate_msa * img_attn
    norm_img = block.norm2(img) * (1 + scale_mlp) + shift_mlp
    img = img + gate_mlp * block.ff(norm_img)

    txt = txt + c_gate_msa.unsqueeze(1) * txt_attn
    norm_txt = block.norm2_context(txt) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
    txt = txt + c_gate_mlp.unsqueeze(1) * block.ff_context(norm_txt)
    if txt.dtype == torch.float16:
        txt = txt.clip(-65504, 65504)
    return img, txt


def _single_block(block, img: torch.Tensor, txt: torch.Tensor, temb: torch.Tensor,
                  packing: FluxPacking) -> tuple[torch.Tensor, torch.Tensor]:
    """`FluxSingleTransformerBlock.forward` with its [text; image] rows split into the text rows [R, L, D]
    and the packed image tokens [1, T, D]; every layer but the attention is per token."""
    norm = block.norm  # AdaLayerNormZeroSingle: shift, scale and gate per row
    shift, scale, gate = norm.linear(norm.silu(temb)).chunk(3, dim=1)
    norm_txt = norm.norm(txt) * (1 + scale[:, None]) + shift[:, None]
    shift, scale, gate_img = packing.per_token(torch.cat([shift, scale, gate], dim=1)).chunk(3, dim=-1)
    norm_img = norm.norm(img) * (1 + scale) + shift
    img_attn, txt_attn = _attention(block.attn, norm_img, norm_txt, packing)

    def branch(x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        return block.proj_out(torch.cat([attn_out, block.act_mlp(block.proj_mlp(x))], dim=2))

    txt = txt + gate.unsqueeze(1) * branch(norm_txt, txt_attn)
    img = img + gate_img * branch(norm_img, img_attn)
    if img.dtype == torch.float16:
        txt, img = txt.clip(-65504, 65504), img.clip(-65504, 65504)
    return img, txt


def embed(transformer, img: torch.Tensor, timestep: torch.Tensor, guidance: Optional[torch.Tensor],
          pooled: torch.Tensor, text_embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's preamble after `x_embedder`: the timestep (and guidance) embedding and the text stream."""
    timestep = timestep.to(img.dtype) * 1000
    if guidance is not None:
        guidance = guidance.to(img.dtype) * 1000
    temb = (transformer.time_text_embed(timestep, pooled) if guidance is None
            else transformer.time_text_embed(timestep, guidance, pooled))
    return temb, transformer.context_embedder(text_embeds)


@torch.inference_mode()
def packed_forward(transformer, latents: torch.Tensor, timestep: torch.Tensor, guidance: Optional[torch.Tensor],
                   pooled: torch.Tensor, text_embeds: torch.Tensor, packing: FluxPacking) -> torch.Tensor:
    """`FluxTransformer2DModel.forward` over rows of different image sizes: latents [R, longest, C]
    (right-padded), one timestep per row; the prediction [R, longest, C], zeros on the padding."""
    img = transformer.x_embedder(packing.pack(latents))
    temb, txt = embed(transformer, img, timestep, guidance, pooled, text_embeds)
    for block in transformer.transformer_blocks:
        img, txt = _double_block(block, img, txt, temb, packing)
    for block in transformer.single_transformer_blocks:
        img, txt = _single_block(block, img, txt, temb, packing)
    return packing.unpack(transformer.proj_out(packing.norm_out(transformer.norm_out, img, temb)))
