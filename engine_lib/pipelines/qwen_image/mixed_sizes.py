"""Qwen-Image requests of different image sizes in one denoise forward, packed (beyond diffusers).

diffusers' transformer takes one RoPE for the whole batch (`img_shapes[0]`). A ragged
batch runs `packed_forward` instead (the packing: engine_lib/pipelines/packing.py): the
image stream packed into one sequence, each token modulated by its own row's timestep
embedding and rotated by its own row's RoPE (image positions from its own `(frames, h,
w)`, text positions after its own largest image index, as `QwenEmbedRope` computes them
for a solo request), the joint attention once per group of rows of one image token
count. The text stream stays one padded row per request, as in diffusers. A batch of
one size runs diffusers' own forward, so solo requests stay bitwise the pipeline's; this
module mirrors `QwenImageTransformer2DModel.forward`, its blocks and
`QwenDoubleStreamAttnProcessor2_0` operation for operation otherwise."""

from __future__ import annotations

import functools
from typing import Optional

import torch
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen, compute_text_seq_len_from_mask

from engine_lib.pipelines.packing import Packing
from engine_lib.pipelines.taylorseer import packed_attention


class QwenPacking(Packing):
    """The packing (engine_lib/pipelines/packing.py) with Qwen-Image's rotary frequencies: each row's image
    positions from its own `(frames, h, w)`, in packed order, and its text's start after its own largest
    image index."""

    def __init__(self, pos_embed, img_shapes: list, device: torch.device) -> None:
        """`img_shapes[r]`: row r's `(frames, h, w)`, or a list of them (an edit's output, then its conditions:
        the i-th at frame index i, as `QwenEmbedRope` places them)."""
        shapes = [list(s) if isinstance(s, list) else [s] for s in img_shapes]
        super().__init__([sum(f * h * w for f, h, w in row) for row in shapes], device)
        self.pos_embed, self.img_shapes = pos_embed, list(img_shapes)
        self.img_freqs = torch.cat([pos_embed._compute_video_freqs(*shape, index, device)
                                    for r in self.order for index, shape in enumerate(shapes[r])])
        # each row's text starts after its own largest image index (host ints: slicing needs no device read)
        self.text_starts = [max(max(h // 2, w // 2) if pos_embed.scale_rope else max(h, w) for _, h, w in row)
                            for row in shapes]

    def _repeat(self, times: int) -> "QwenPacking":
        return QwenPacking(self.pos_embed, self.img_shapes * times, self.device)

    def subset(self, rows: list[int]) -> "QwenPacking":
        """The packing of just the rows `rows`, in that order."""
        return QwenPacking(self.pos_embed, [self.img_shapes[r] for r in rows], self.device)

    def text_freqs(self, text_len: int) -> torch.Tensor:
        """Per row: the text frequencies [R, text_len, D/2], starting at the row's own index."""
        pos_freqs, _ = self.pos_embed._get_device_freqs(self.device)
        return torch.stack([pos_freqs[start:start + text_len] for start in self.text_starts])


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """`apply_rotary_emb_qwen(use_real=False)` with one frequency table per row: x [B, S, H, D], freqs [B, S, D/2]."""
    rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(rotated * freqs.unsqueeze(2)).flatten(3).type_as(x)


def _modulate(x: torch.Tensor, mod_params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`QwenImageTransformerBlock._modulate` with shift, scale and gate already per token ([1, T, 3D])."""
    shift, scale, gate = mod_params.chunk(3, dim=-1)
    return x * (1 + scale) + shift, gate


def _attention(attn, img: torch.Tensor, txt: torch.Tensor, txt_mask: Optional[torch.Tensor], text_len: int,
               packing: QwenPacking) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention module `attn` on a packed image stream (under TaylorSeer: taylorseer.packed_attention)."""
    return packed_attention(attn, functools.partial(_joint, attn, text_len), packing, img, txt, txt_mask)


def _joint(attn, text_len: int, packing: QwenPacking, img: torch.Tensor, txt: torch.Tensor,
           txt_mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`QwenDoubleStreamAttnProcessor2_0` with a packed image stream: projections per real token, the joint
    attention once per group of rows with one image token count, over [their text, their image tokens]."""
    txt_freqs = packing.kept("text_freqs", text_len, None, lambda: packing.text_freqs(text_len))
    head_dim = attn.inner_dim // attn.heads

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (-1, head_dim))

    img_q, img_k, img_v = heads(attn.to_q(img)), heads(attn.to_k(img)), heads(attn.to_v(img))
    txt_q, txt_k, txt_v = heads(attn.add_q_proj(txt)), heads(attn.add_k_proj(txt)), heads(attn.add_v_proj(txt))
    if attn.norm_q is not None:
        img_q = attn.norm_q(img_q)
    if attn.norm_k is not None:
        img_k = attn.norm_k(img_k)
    if attn.norm_added_q is not None:
        txt_q = attn.norm_added_q(txt_q)
    if attn.norm_added_k is not None:
        txt_k = attn.norm_added_k(txt_k)
    img_q = apply_rotary_emb_qwen(img_q, packing.img_freqs, use_real=False)  # one sequence: diffusers' own
    img_k = apply_rotary_emb_qwen(img_k, packing.img_freqs, use_real=False)
    txt_q, txt_k = _rotate(txt_q, txt_freqs), _rotate(txt_k, txt_freqs)
    txt_joint, img_joint = packing.attend(attn, txt_q, txt_k, txt_v, img_q, img_k, img_v, txt_mask)
    img_out = attn.to_out[0](img_joint)
    if len(attn.to_out) > 1:
        img_out = attn.to_out[1](img_out)
    return img_out, attn.to_add_out(txt_joint.contiguous())


def _block(block, img: torch.Tensor, txt: torch.Tensor, txt_mask: Optional[torch.Tensor], temb: torch.Tensor,
           text_len: int, packing: QwenPacking) -> tuple[torch.Tensor, torch.Tensor]:
    """`QwenImageTransformerBlock.forward` on a packed image stream (img [1, T, D]; txt [R, L, D]; temb [R, D])."""
    img_mod1, img_mod2 = packing.per_token(block.img_mod(temb)).chunk(2, dim=-1)
    txt_mod1, txt_mod2 = block.txt_mod(temb).chunk(2, dim=-1)
    img_modulated, img_gate1 = _modulate(block.img_norm1(img), img_mod1)
    txt_modulated, txt_gate1 = block._modulate(block.txt_norm1(txt), txt_mod1)
    img_attn, txt_attn = _attention(block.attn, img_modulated, txt_modulated, txt_mask, text_len, packing)
    img = img + img_gate1 * img_attn
    txt = txt + txt_gate1 * txt_attn
    img_modulated2, img_gate2 = _modulate(block.img_norm2(img), img_mod2)
    img = img + img_gate2 * block.img_mlp(img_modulated2)
    txt_modulated2, txt_gate2 = block._modulate(block.txt_norm2(txt), txt_mod2)
    txt = txt + txt_gate2 * block.txt_mlp(txt_modulated2)
    if txt.dtype == torch.float16:
        txt = txt.clip(-65504, 65504)
    if img.dtype == torch.float16:
        img = img.clip(-65504, 65504)
    return img, txt


def embed(transformer, img: torch.Tensor, timestep: torch.Tensor, guidance: Optional[torch.Tensor],
          text_embeds: torch.Tensor, text_mask: Optional[torch.Tensor]):
    """The forward's preamble after `img_in`: the text stream, its length and mask, the timestep embedding."""
    timestep = timestep.to(img.dtype)
    txt = transformer.txt_in(transformer.txt_norm(text_embeds))
    text_len, _, txt_mask = compute_text_seq_len_from_mask(txt, text_mask)
    if guidance is not None:
        guidance = guidance.to(img.dtype) * 1000
    temb = (transformer.time_text_embed(timestep, img) if guidance is None
            else transformer.time_text_embed(timestep, guidance, img))
    return txt, text_len, txt_mask, temb


@torch.inference_mode()
def packed_forward(transformer, latents: torch.Tensor, timestep: torch.Tensor, guidance: Optional[torch.Tensor],
                   text_embeds: torch.Tensor, text_mask: Optional[torch.Tensor], packing: QwenPacking) -> torch.Tensor:
    """`QwenImageTransformer2DModel.forward` over rows of different image sizes: latents [R, longest, C]
    (right-padded), one timestep per row; the prediction [R, longest, C], zeros on the padding."""
    if transformer.zero_cond_t:
        raise NotImplementedError("mixed sizes with zero_cond_t (edit checkpoints) are not supported")
    img = transformer.img_in(packing.pack(latents))
    txt, text_len, txt_mask, temb = embed(transformer, img, timestep, guidance, text_embeds, text_mask)
    for block in transformer.transformer_blocks:
        img, txt = _block(block, img, txt, txt_mask, temb, text_len, packing)
    return packing.unpack(transformer.proj_out(packing.norm_out(transformer.norm_out, img, temb)))
