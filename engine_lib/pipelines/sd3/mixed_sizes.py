"""SD3 requests of different image sizes in one denoise forward, packed (beyond diffusers).

`SD3Transformer2DModel` patchifies 4-D latents of one size, adds a crop of its absolute
position table for that size, and unpatchifies back to that size. A ragged batch runs
`packed_forward` instead (the packing: engine_lib/pipelines/packing.py): each size's rows
go through `pos_embed` (patchify and their own crop of the table) together, the patch tokens
of every row are packed into one sequence, each token modulated by its own row's timestep
embedding, the joint attention ([image; text], as `JointAttnProcessor2_0` orders it) once
per group of rows of one patch count, and each size's rows are unpatchified again. A batch
of one size runs diffusers' own forward, so solo requests stay bitwise the pipeline's; this
module mirrors `SD3Transformer2DModel.forward`, `JointTransformerBlock` (SD3.5's dual
attention and qk norms included) and `JointAttnProcessor2_0` operation for operation otherwise.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Optional

import torch

from engine_lib.host_copy import to_device
from engine_lib.lora import LoraLibrary
from engine_lib.pipelines.packing import Packing
from engine_lib.pipelines.sd3.tokens import from_tokens, to_tokens
from engine_lib.pipelines.taylorseer import packed_attention


class SD3Packing(Packing):
    """The packing of rows with latent sizes `sizes` [(h, w)]: one token per patch (the engine's token latents,
    one per latent pixel, are patchified and unpatchified here, not `pack`ed)."""

    def __init__(self, sizes: list[tuple[int, int]], patch_size: int, device: torch.device) -> None:
        lengths = [(h // patch_size) * (w // patch_size) for h, w in sizes]
        super().__init__(lengths, device)
        self.sizes, self.patch_size = list(sizes), patch_size
        by_size: dict[tuple[int, int], list[int]] = {}  # rows of one size share pos_embed and unpatchify
        for row, size in enumerate(self.sizes):
            by_size.setdefault(size, []).append(row)
        self.by_size = {size: (rows, to_device(rows, device)) for size, rows in by_size.items()}
        self.starts, start = {}, 0  # each row's first token in the packed sequence
        for row in self.order:
            self.starts[row] = start
            start += lengths[row]

    def _repeat(self, times: int) -> "SD3Packing":
        return SD3Packing(self.sizes * times, self.patch_size, self.device)

    def subset(self, rows: list[int]) -> "SD3Packing":
        """The packing of just the rows `rows`, in that order."""
        return SD3Packing([self.sizes[r] for r in rows], self.patch_size, self.device)

    def patchify(self, pos_embed, latents: torch.Tensor, loras: Optional[LoraLibrary] = None) -> torch.Tensor:
        """Token latents [R, longest, C] -> packed patch embeddings [1, T, D], each row with its size's crop
        (and, with `loras`, its own LoRA on the patch convolution)."""
        embedded: dict[int, torch.Tensor] = {}
        for (h, w), (rows, rows_on_device) in self.by_size.items():
            own = latents[:, :h * w].index_select(0, rows_on_device)
            with loras.only(rows) if loras is not None else nullcontext():
                patches = pos_embed(from_tokens(own, h, w))
            for row, tokens in zip(rows, patches):
                embedded[row] = tokens
        return torch.cat([embedded[row] for row in self.order]).unsqueeze(0)

    def unpatchify(self, packed: torch.Tensor, out_channels: int) -> torch.Tensor:
        """Packed patch outputs [1, T, p * p * C] -> token latents [R, longest, C], zeros on the padding."""
        p = self.patch_size
        out = packed.new_zeros(self.rows, max(h * w for h, w in self.sizes), out_channels)
        for (h, w), (rows, rows_on_device) in self.by_size.items():
            n = (h // p) * (w // p)
            x = torch.stack([packed[0, self.starts[row]:self.starts[row] + n] for row in rows])
            x = torch.einsum("nhwpqc->nchpwq", x.reshape(len(rows), h // p, w // p, p, p, out_channels))
            out[:, :h * w].index_copy_(0, rows_on_device, to_tokens(x.reshape(len(rows), out_channels, h, w)))
        return out


def _qkv(attn, x: torch.Tensor, projections, norms) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value of `x` [..., S, D] by `projections`, as [..., S, H, D / H]; query and key through
    `norms` (None: none), as `JointAttnProcessor2_0` does."""
    q, k, v = (projection(x).unflatten(-1, (attn.heads, -1)) for projection in projections)
    norm_q, norm_k = norms
    return q if norm_q is None else norm_q(q), k if norm_k is None else norm_k(k), v


def _attention(attn, img: torch.Tensor, txt: torch.Tensor, packing: SD3Packing) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention module `attn` on a packed image stream (under TaylorSeer: taylorseer.packed_attention)."""
    return packed_attention(attn, functools.partial(_joint, attn), packing, img, txt)


def _joint(attn, packing: SD3Packing, img: torch.Tensor, txt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`JointAttnProcessor2_0` with a packed image stream: projections per real token, the joint attention
    once per group; the text part unprojected after a `context_pre_only` block (its last), as diffusers'."""
    img_q, img_k, img_v = _qkv(attn, img, (attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k))
    txt_q, txt_k, txt_v = _qkv(attn, txt, (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj),
                               (attn.norm_added_q, attn.norm_added_k))
    txt_out, img_out = packing.attend(attn, txt_q, txt_k, txt_v, img_q, img_k, img_v, image_first=True)
    img_out = attn.to_out[1](attn.to_out[0](img_out))
    return img_out, txt_out if attn.context_pre_only else attn.to_add_out(txt_out)


def _self_attention(attn, img: torch.Tensor, packing: SD3Packing) -> torch.Tensor:
    """SD3.5's second (image-only) attention, each row over its own tokens."""
    q, k, v = _qkv(attn, img, (attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k))
    return attn.to_out[1](attn.to_out[0](packing.self_attend(attn, q, k, v)))


def _block(block, img: torch.Tensor, txt: torch.Tensor, temb: torch.Tensor, packing: SD3Packing):
    """`JointTransformerBlock.forward` on a packed image stream (img [1, T, D]; txt [R, L, D]; temb [R, D])."""
    assert block._chunk_size is None, "chunked feed-forward is not mirrored here"
    norm1 = block.norm1  # AdaLayerNormZero (six parameters per token) or SD35AdaLayerNormZeroX (nine)
    chunks = packing.per_token(norm1.linear(norm1.silu(temb))).chunk(9 if block.use_dual_attention else 6, dim=-1)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = chunks[:6]
    normed = norm1.norm(img)
    norm_img = normed * (1 + scale_msa) + shift_msa
    if block.context_pre_only:
        norm_txt = block.norm1_context(txt, temb)
    else:
        norm_txt, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(txt, emb=temb)
    img_attn, txt_attn = _attention(block.attn, norm_img, norm_txt, packing)

    img = img + gate_msa * img_attn
    if block.use_dual_attention:
        shift_msa2, scale_msa2, gate_msa2 = chunks[6:]
        img = img + gate_msa2 * _self_attention(block.attn2, normed * (1 + scale_msa2) + shift_msa2, packing)
    norm_img = block.norm2(img) * (1 + scale_mlp) + shift_mlp
    img = img + gate_mlp * block.ff(norm_img)
    if block.context_pre_only:
        return img, None

    txt = txt + c_gate_msa.unsqueeze(1) * txt_attn
    norm_txt = block.norm2_context(txt) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
    return img, txt + c_gate_mlp.unsqueeze(1) * block.ff_context(norm_txt)


@torch.inference_mode()
def packed_forward(transformer, latents: torch.Tensor, timestep: torch.Tensor, pooled: torch.Tensor,
                   text_embeds: torch.Tensor, packing: SD3Packing, loras: Optional[LoraLibrary] = None) -> torch.Tensor:
    """`SD3Transformer2DModel.forward` over rows of different image sizes: token latents [R, longest, C]
    (right-padded), one timestep per row; the prediction [R, longest, C], zeros on the padding. `loras`:
    the library whose `rows` and `packed` plans this forward runs within."""
    img = packing.patchify(transformer.pos_embed, latents, loras)
    temb = transformer.time_text_embed(timestep, pooled)
    txt = transformer.context_embedder(text_embeds)
    for block in transformer.transformer_blocks:
        img, txt = _block(block, img, txt, temb, packing)
    img = transformer.proj_out(packing.norm_out(transformer.norm_out, img, temb))
    return packing.unpatchify(img, transformer.out_channels)
