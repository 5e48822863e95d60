"""SD3's transformer with the first-block cache decided per row group (engine_lib/pipelines/step_cache.py).

SD3's blocks are one list of `JointTransformerBlock`s, Qwen-Image's shape: the head is the first block, the
tail the last. diffusers' hook itself does not run on SD3 (its transformer has no cache context, and its tail
hook subtracts from the text output that SD3's last, `context_pre_only`, block does not return); the math here
is the hook's with that text residual left out, which changes nothing the forward returns (the text stream
ends at the last block). `cached_forward` is `SD3Transformer2DModel.forward` operation for operation (rows of
one size), `cached_packed_forward` is mixed_sizes.packed_forward (rows of different sizes), each with its block
loop handed to `step_cache.run_joint_blocks`. A row that computes every block gets what the plain forward gives it.
"""

from __future__ import annotations


import torch

from engine_lib.pipelines import step_cache, taylorseer
from engine_lib.pipelines.sd3.mixed_sizes import SD3Packing, _block


@torch.inference_mode()
def cached_forward(transformer, loras, latents: torch.Tensor, timestep: torch.Tensor, pooled: torch.Tensor,
                   text_embeds: torch.Tensor, groups: list[step_cache.RowGroup], seer=None) -> torch.Tensor:
    """`SD3Transformer2DModel.forward` (latents [R, C, h, w] of one size) with per-group skips."""
    height, width = latents.shape[-2:]
    img = transformer.pos_embed(latents).contiguous()
    temb = transformer.time_text_embed(timestep, pooled)
    txt = transformer.context_embedder(text_embeds)
    blocks = transformer.transformer_blocks

    def run(which, img, txt, temb):
        for block in blocks[which]:
            txt, img = block(hidden_states=img, encoder_hidden_states=txt, temb=temb, joint_attention_kwargs=None)
        return img, txt

    img = step_cache.run_joint_blocks(groups, loras, img, txt, (temb,), run, seer=seer)
    img = transformer.proj_out(transformer.norm_out(img, temb))
    p, channels = transformer.config.patch_size, transformer.out_channels  # unpatchify, as the forward does
    img = img.reshape(shape=(img.shape[0], height // p, width // p, p, p, channels))
    img = torch.einsum("nhwpqc->nchpwq", img)
    return img.reshape(shape=(img.shape[0], channels, height // p * p, width // p * p))


@torch.inference_mode()
def cached_packed_forward(transformer, loras, latents: torch.Tensor, timestep: torch.Tensor, pooled: torch.Tensor,
                          text_embeds: torch.Tensor, packing: SD3Packing,
                          groups: list[step_cache.RowGroup]) -> torch.Tensor:
    """mixed_sizes.packed_forward with per-group skips: the residuals are compared in the padded row layout, each
    group over its own patches; the rows that compute run the other blocks packed on their own (a packing of just
    their sizes, made in that tick)."""
    img = packing.patchify(transformer.pos_embed, latents, loras)
    temb = transformer.time_text_embed(timestep, pooled)
    txt = transformer.context_embedder(text_embeds)
    blocks = transformer.transformer_blocks

    def run(which, img, txt, temb, packing):
        for block in blocks[which]:
            img, txt = _block(block, img, txt, temb, packing)
        return img, txt

    img = packing.pack(step_cache.run_joint_blocks(groups, loras, packing.unpack(img), txt, (temb,), run, packing,
                                                   seer=taylorseer.running(transformer)))
    img = transformer.proj_out(packing.norm_out(transformer.norm_out, img, temb))
    return packing.unpatchify(img, transformer.out_channels)
