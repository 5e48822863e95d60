"""Qwen-Image requests of different image sizes in one denoise forward (beyond diffusers).

diffusers' transformer takes one RoPE for the whole batch (`img_shapes[0]`) and
attends to every image token. Rows of different sizes are right-padded to the
longest image sequence (`InputBatch.gather`); this module gives each row its own
rotary frequencies (image positions from its own `(frames, h, w)`, text positions
after its own largest image index, as `QwenEmbedRope` computes them for a solo
request) and a key mask that hides the padding. A batch of one size runs
diffusers' processor unchanged, so solo requests stay bitwise the pipeline's.
"""

from __future__ import annotations

from typing import Optional

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0


def row_rope(pos_embed, img_shapes: list[tuple[int, int, int]], longest: int,
             device: torch.device) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Per row: image frequencies [R, longest, D/2] (padding: 1, no rotation), the row's text start
    index (its largest image index; host ints, which slicing needs without reading the device), and
    the image-token mask [R, longest]."""
    freqs, starts, masks = [], [], []
    for frames, height, width in img_shapes:
        video = pos_embed._compute_video_freqs(frames, height, width, 0, device)
        pad = longest - video.shape[0]
        freqs.append(torch.cat([video, video.new_ones(pad, video.shape[1])]) if pad else video)
        starts.append(max(height // 2, width // 2) if pos_embed.scale_rope else max(height, width))
        masks.append(torch.arange(longest, device=device) < video.shape[0])
    return torch.stack(freqs), starts, torch.stack(masks)


def text_rope(pos_embed, starts: list[int], text_len: int, device: torch.device) -> torch.Tensor:
    """Per row: the text frequencies [R, text_len, D/2], starting at the row's own index."""
    pos_freqs, _ = pos_embed._get_device_freqs(device)
    return torch.stack([pos_freqs[start:start + text_len] for start in starts])


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """`apply_rotary_emb_qwen(use_real=False)` with one frequency table per row: x [B, S, H, D], freqs [B, S, D/2]."""
    rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(rotated * freqs.unsqueeze(2)).flatten(3).type_as(x)


class MixedSizeAttnProcessor(QwenDoubleStreamAttnProcessor2_0):
    """diffusers' joint text-image attention; with `row_rotary_emb` and `image_mask` (a ragged batch),
    per-row RoPE and the padded image tokens masked out as keys."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor = None,
                 encoder_hidden_states_mask: Optional[torch.Tensor] = None, attention_mask=None,
                 image_rotary_emb=None, row_rotary_emb: Optional[tuple] = None,
                 image_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        if row_rotary_emb is None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                                    attention_mask, image_rotary_emb)
        head_dim = attn.inner_dim // attn.heads

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(-1, (-1, head_dim))

        img_q, img_k, img_v = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), \
            heads(attn.to_v(hidden_states))
        txt_q, txt_k, txt_v = heads(attn.add_q_proj(encoder_hidden_states)), \
            heads(attn.add_k_proj(encoder_hidden_states)), heads(attn.add_v_proj(encoder_hidden_states))
        if attn.norm_q is not None:
            img_q = attn.norm_q(img_q)
        if attn.norm_k is not None:
            img_k = attn.norm_k(img_k)
        if attn.norm_added_q is not None:
            txt_q = attn.norm_added_q(txt_q)
        if attn.norm_added_k is not None:
            txt_k = attn.norm_added_k(txt_k)
        img_freqs, txt_freqs = row_rotary_emb
        img_q, img_k = _rotate(img_q, img_freqs), _rotate(img_k, img_freqs)
        txt_q, txt_k = _rotate(txt_q, txt_freqs), _rotate(txt_k, txt_freqs)

        text_mask = encoder_hidden_states_mask
        if text_mask is None:
            text_mask = torch.ones(encoder_hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device)
        mask = torch.cat([text_mask.to(torch.bool), image_mask], dim=1)[:, None, None, :]
        joint = dispatch_attention_fn(torch.cat([txt_q, img_q], dim=1), torch.cat([txt_k, img_k], dim=1),
                                      torch.cat([txt_v, img_v], dim=1), attn_mask=mask, dropout_p=0.0,
                                      is_causal=False, backend=self._attention_backend,
                                      parallel_config=self._parallel_config)
        joint = joint.flatten(2, 3).to(txt_q.dtype)
        seq_txt = encoder_hidden_states.shape[1]
        img_out = attn.to_out[0](joint[:, seq_txt:].contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        return img_out, attn.to_add_out(joint[:, :seq_txt].contiguous())

