"""Qwen-Image behind the engine's contracts: `QwenImagePipeline.__call__` cut into its phases.

The shared skeleton (the image inputs and output, request-local scheduler,
batched CFG, batched decode, previews) is `FlowMatchAdapter`; this module holds
what is Qwen-Image's own, each piece calling the pipeline's helpers:

* text: `encode_prompt` (and the negative prompt for true CFG); prompts of
  different lengths share a forward, right-padded with a mask;
* latents: `prepare_latents` (packed 2x2), the RoPE `img_shapes` per row; rows of
  different sizes share a step batch, their image tokens packed, each row its own RoPE (mixed_sizes.py);
* timesteps: `calculate_shift` on the packed sequence length, sigmas `linspace(1, 1/n, n)`;
* transformer: timestep `/ 1000`, true CFG with diffusers' norm rescale;
* decode: `_unpack_latents`, the VAE's `latents_mean`/`latents_std` de-normalisation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from engine_lib.interface import InputSpec, replace_spec
from engine_lib.pipelines.flow_match import (GUIDANCE_SCALE, IMAGE_INPUTS, TRUE_CFG_SCALE, FlowMatchAdapter,
                                             FlowMatchState, TextParts, max_sequence_length)
from engine_lib.pipelines.qwen_image.first_block import cached_forward, cached_packed_forward
from engine_lib.pipelines.qwen_image.mixed_sizes import QwenPacking, packed_forward
from engine_lib.pipelines.step_cache import ALL_CACHE_INPUTS
from engine_lib.pipelines.vae import video_vae_stats

DEFAULT_MAX_SEQUENCE_LENGTH = 512  # QwenImagePipeline.__call__'s default
MAX_SEQUENCE_LENGTH = 1024  # QwenImagePipeline.check_inputs rejects more


@dataclass
class QwenImageState(FlowMatchState):
    img_shape: tuple = ()  # (frames, latent height / 2, latent width / 2): the RoPE shape of each row


class QwenImageAdapter(FlowMatchAdapter):
    """`QwenImagePipeline` (text-to-image) with request batching, step execution and previews.

    `guidance_scale` is used only by guidance-distilled checkpoints
    (`transformer.config.guidance_embeds`), where it is required, as in diffusers.
    """

    name = "qwen_image"
    pipeline_class = "QwenImagePipeline"
    cost_reference = {"height": 1024, "width": 1024, "negative_prompt": "", "true_cfg_scale": 4.0}
    inputs = replace_spec(
        IMAGE_INPUTS, "num_inference_steps", low=2,
        low_note="Qwen-Image's shift_terminal schedule gives NaN sigmas for a single step",
    ) + (
        max_sequence_length(default=DEFAULT_MAX_SEQUENCE_LENGTH, high=MAX_SEQUENCE_LENGTH),
        replace(TRUE_CFG_SCALE, default=4.0),  # QwenImagePipeline.__call__'s default
        replace(GUIDANCE_SCALE, doc="embedded guidance of guidance-distilled checkpoints (required there)"),
        *ALL_CACHE_INPUTS,
    )
    state_class = QwenImageState
    pads_text = True
    capabilities = FlowMatchAdapter.capabilities.with_features(
        "mixed_sizes", "first_block", "taylorseer", "cfg_parallel", "sequence_parallel").allow(
        "cfg_parallel", "sequence_parallel")  # two CFG groups of sequence-parallel ranks (cfg_parallel.py)
    step_key_skips = ("height", "width")  # with mixed_size_batching, sizes share a step batch (mixed_sizes.py)

    def __init__(self, pipe, device, dtype, config=None):
        super().__init__(pipe, device, dtype, config)
        self._latents_mean, self._latents_std = video_vae_stats(self.pipe.vae, self.device)

    def input_specs(self) -> tuple[InputSpec, ...]:
        if self.pipe.transformer.config.guidance_embeds:
            return replace_spec(super().input_specs(), "guidance_scale", required=True)
        return replace_spec(super().input_specs(), "guidance_scale",
                            unused="this checkpoint is not guidance-distilled (use true_cfg_scale with a "
                                   "negative_prompt)")

    # -- pipeline-specific phases ------------------------------------------------
    def _encode(self, state: QwenImageState) -> dict[str, TextParts]:
        params = state.params
        msl = self.text_length(params)
        text = {}
        sides = {"cond": params.prompt}
        if self.do_cfg(params):
            sides["uncond"] = params.negative_prompt
        for side, prompt in sides.items():
            embeds, mask = self.pipe.encode_prompt(prompt, device=self.device, num_images_per_prompt=params.num_images,
                                                   max_sequence_length=msl)
            text[side] = {"embeds": embeds, "mask": mask}
        return text

    def _initial_latents(self, state: QwenImageState) -> torch.Tensor:
        pipe, p = self.pipe, state.params
        num_channels_latents = pipe.transformer.config.in_channels // 4
        dtype = state.text["cond"]["embeds"].dtype
        latents = pipe.prepare_latents(p.num_images, num_channels_latents, p.height, p.width, dtype, self.device,
                                       state.generator)
        state.img_shape = (1, p.height // pipe.vae_scale_factor // 2, p.width // pipe.vae_scale_factor // 2)
        return latents

    def _timestep_kwargs(self, state: QwenImageState) -> dict:
        n = state.params.num_inference_steps
        return {"sigmas": np.linspace(1.0, 1 / n, n), "mu": self._shift(state.latents.shape[1])}

    def _row_inputs(self, states: list[QwenImageState]) -> dict:
        shapes = [s.img_shape for s in states for _ in range(s.num_rows)]
        rows = {"img_shapes": [[shape] for shape in shapes], "guidance": self._guidance_rows(states)}
        if len(set(shapes)) > 1:  # a ragged batch: image tokens packed, each row its own RoPE
            rows["packing"] = QwenPacking(self.pipe.transformer.pos_embed, shapes, self.device)
        return rows

    # -- the forwards FlowMatchAdapter._forward chooses from ---------------------------
    def _plain_forward(self, latents, timestep, text, rows, states) -> torch.Tensor:
        return self.pipe.transformer(
            hidden_states=latents,
            timestep=timestep,
            guidance=rows["guidance"],
            encoder_hidden_states_mask=text["mask"],
            encoder_hidden_states=text["embeds"],
            img_shapes=rows["img_shapes"],
            return_dict=False,
        )[0]

    def _packed_forward(self, latents, timestep, text, rows) -> torch.Tensor:
        return packed_forward(self.pipe.transformer, latents, timestep, rows["guidance"], text["embeds"],
                              text["mask"], rows["packing"])

    def _cached_forward(self, latents, timestep, text, rows, states, groups, seer) -> torch.Tensor:
        return cached_forward(self.pipe.transformer, self.loras, latents, timestep, rows["guidance"],
                              text["embeds"], text["mask"], rows["img_shapes"], groups, seer)

    def _cached_packed_forward(self, latents, timestep, text, rows, groups) -> torch.Tensor:
        return cached_packed_forward(self.pipe.transformer, self.loras, latents, timestep, rows["guidance"],
                                     text["embeds"], text["mask"], rows["packing"], groups)

    def _combine_cfg(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """diffusers' true CFG: the guided prediction rescaled to the conditional one's norm, per token."""
        comb = uncond + scale * (cond - uncond)
        cond_norm = torch.norm(cond, dim=-1, keepdim=True)
        noise_norm = torch.norm(comb, dim=-1, keepdim=True)
        return comb * (cond_norm / noise_norm)

    @property
    def latent_channels(self) -> int:
        return int(self.pipe.vae.config.z_dim)

    def _unpack(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        # [N, C, 1, h, w] (one frame) -> [N, C, h, w]
        return self.pipe._unpack_latents(latents, height, width, self.pipe.vae_scale_factor)[:, :, 0]

    def _vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        """The pipeline's de-normalisation, operation for operation, on the one-frame video VAE."""
        latents = latents.unsqueeze(2).to(self.pipe.vae.dtype)
        latents = latents / self._latents_std + self._latents_mean
        return self.pipe.vae.decode(latents, return_dict=False)[0][:, :, 0]


ADAPTER = QwenImageAdapter
