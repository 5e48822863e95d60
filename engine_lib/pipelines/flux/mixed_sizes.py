"""Flux requests of different image sizes in one denoise forward (beyond diffusers).

diffusers' transformer builds one RoPE table for the whole batch from 2-D
`txt_ids`/`img_ids` and attends to every token. Rows of different sizes are
right-padded to the longest image sequence (`InputBatch.gather`); this module
gives each row the rotary table of its own ids (`FluxPosEmbed` over the row's
text and image ids, exactly what a solo forward computes) and a key mask that
hides the padding, in the double-stream and the single-stream blocks alike (both
attend over [text; image]). A batch of one size runs diffusers' processor
unchanged, so solo requests stay bitwise the pipeline's.
"""

from __future__ import annotations

from typing import Optional

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, _get_qkv_projections


def row_rope(pos_embed, txt_ids: torch.Tensor, img_ids: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per row: the rotary tables `rope_cos`, `rope_sin` [R, L + longest, D] of its own [text; image] ids
    (padding: cos 1, sin 0, no rotation) and the key mask `attention_mask` [R, 1, 1, L + longest]."""
    longest = max(ids.shape[0] for ids in img_ids)
    cos_rows, sin_rows, masks = [], [], []
    for ids in img_ids:
        cos, sin = pos_embed(torch.cat([txt_ids, ids]))
        pad = longest - ids.shape[0]
        cos_rows.append(torch.cat([cos, cos.new_ones(pad, cos.shape[1])]))
        sin_rows.append(torch.cat([sin, sin.new_zeros(pad, sin.shape[1])]))
        masks.append(torch.arange(cos.shape[0] + pad, device=cos.device) < cos.shape[0])
    return {"rope_cos": torch.stack(cos_rows), "rope_sin": torch.stack(sin_rows),
            "attention_mask": torch.stack(masks)[:, None, None, :]}


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary_emb(x, (cos, sin), sequence_dim=1)` (Flux's real form) with one table per row:
    x [B, S, H, D], cos and sin [B, S, D]."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


class MixedSizeFluxAttnProcessor(FluxAttnProcessor):
    """diffusers' Flux attention; with `rope_cos`/`rope_sin` (a ragged batch), each row rotated by its own
    table, and `attention_mask` hiding the padded image tokens as keys."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor = None,
                 attention_mask: Optional[torch.Tensor] = None, image_rotary_emb=None,
                 rope_cos: Optional[torch.Tensor] = None, rope_sin: Optional[torch.Tensor] = None) -> torch.Tensor:
        if rope_cos is None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        query, key, value, encoder_query, encoder_key, encoder_value = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states)
        query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in (query, key, value))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if attn.added_kv_proj_dim is not None:  # a double-stream block: text and image streams joined here
            encoder_query, encoder_key, encoder_value = (
                t.unflatten(-1, (-1, attn.head_dim)) for t in (encoder_query, encoder_key, encoder_value))
            query = torch.cat([attn.norm_added_q(encoder_query), query], dim=1)
            key = torch.cat([attn.norm_added_k(encoder_key), key], dim=1)
            value = torch.cat([encoder_value, value], dim=1)
        query, key = _rotate(query, rope_cos, rope_sin), _rotate(key, rope_cos, rope_sin)
        hidden_states = dispatch_attention_fn(query, key, value, attn_mask=attention_mask,
                                              backend=self._attention_backend, parallel_config=self._parallel_config)
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return hidden_states
        text_len = encoder_hidden_states.shape[1]
        encoder_hidden_states, hidden_states = hidden_states[:, :text_len], hidden_states[:, text_len:]
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.contiguous()))
        return hidden_states, attn.to_add_out(encoder_hidden_states.contiguous())
