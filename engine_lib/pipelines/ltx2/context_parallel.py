"""LTX-2's context-parallel plan (sequence parallel: video_sequence_parallel.py), fitted to the checkpoint.

diffusers' own `LTX2VideoTransformer3DModel._cp_plan` splits the video tokens, the text tokens and the text mask
at the model's input and the video RoPE tables as [B, S, D]. Three things it leaves out, each a wrong shape or a
wrong sum on a rank:

* split RoPE (`rope_type="split"`, LTX-2's own) returns [B, H, S, D/2] tables: their tokens are dim 2;
* the audio-video cross-attention's video RoPE (`cross_attn_rope`) is per video token too, so it is split like
  the video tokens it rotates;
* image to video passes one timestep per video token ([B, S]; 0 on the image's frame): split with the tokens (a
  text-to-video call's [B] timestep is the whole batch's and stays whole).

The audio tokens stay whole on every rank: attention over them (and between them and the video's shares) is
exact, each rank computing the audio part alike. The video output is gathered at `proj_out`.

One shim: LTX-2's attention repeats its text mask over the heads ([B, H, 1, T]), and diffusers' Ulysses attention
gathers the mask's tokens but keeps all H heads while each rank attends with H / n of them, a shape the
attention refuses. Every head's mask is the same one, so on a rank a mask with more heads than the query is
narrowed to its first head, which broadcasts over the rank's heads (`one_head_masks`). (The mask LTX-2's
connectors return is all ones, padding included, so only its shape matters today.)
"""

from __future__ import annotations

import functools


def plan(transformer) -> dict:
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    def split(dim: int, dims: int, output: bool = False) -> ContextParallelInput:
        return ContextParallelInput(split_dim=dim, expected_dims=dims, split_output=output)

    rope = split(2, 4, True) if transformer.config.rope_type == "split" else split(1, 3, True)
    return {
        "": {"hidden_states": split(1, 3), "encoder_hidden_states": split(1, 3),
             "encoder_attention_mask": split(1, 2), "timestep": split(1, 2)},
        "rope": {0: rope, 1: rope},
        "cross_attn_rope": {0: rope, 1: rope},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def one_head_masks() -> None:
    """On a rank (a process of its own): diffusers' native attention reads a head-repeated mask as one head."""
    from diffusers.models import attention_dispatch

    forward_op = attention_dispatch._native_attention_forward_op
    if getattr(forward_op, "one_head_masks", False):
        return

    @functools.wraps(forward_op)
    def narrowed(ctx, query, key, value, attn_mask=None, *args, **kwargs):
        if attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[1] > query.shape[2]:
            attn_mask = attn_mask[:, :1]  # (query: [B, S, H / n, D] after the all_to_all)
        return forward_op(ctx, query, key, value, attn_mask, *args, **kwargs)

    narrowed.one_head_masks = True
    attention_dispatch._native_attention_forward_op = narrowed
