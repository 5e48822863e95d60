"""Flux behind the engine's contracts: `FluxPipeline.__call__` cut into its phases.

The shared skeleton is `FlowMatchAdapter`; this module holds what is Flux's own,
each piece calling the pipeline's helpers:

* text: `encode_prompt` (CLIP pooled + T5 padded to `max_sequence_length`, and
  the negative prompt for true CFG); `txt_ids` are shared by the whole batch;
* latents: `prepare_latents` (packed 2x2) with `img_ids`, shared by the batch; with
  `mixed_size_batching`, rows of different sizes share a step batch, their image tokens
  packed, each with the RoPE of its own ids (mixed_sizes.py);
* timesteps: sigmas `linspace(1, 1/n, n)`, `calculate_shift` on the packed sequence length;
* transformer: timestep in the latents' dtype `/ 1000`, embedded guidance per
  row (float32, as the pipeline builds it), true CFG without a rescale;
* decode: `_unpack_latents`, `/ scaling_factor + shift_factor`, `vae.decode`.

Shared `txt_ids` mean one forward holds one text length (`max_sequence_length` is in
the keys); the image size is too, unless `mixed_size_batching` is on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch

from engine_lib.interface import InputSpec, replace_spec
from engine_lib.pipelines.flow_match import (GUIDANCE_SCALE, IMAGE_INPUTS, TRUE_CFG_SCALE, FlowMatchAdapter,
                                             FlowMatchState, TextParts, max_sequence_length)
from engine_lib.pipelines.flux.first_block import cached_forward, cached_packed_forward
from engine_lib.pipelines.flux.mixed_sizes import FluxPacking, packed_forward
from engine_lib.pipelines.step_cache import ALL_CACHE_INPUTS

DEFAULT_GUIDANCE_SCALE = 3.5  # FluxPipeline.__call__'s default
DEFAULT_MAX_SEQUENCE_LENGTH = 512  # FluxPipeline.__call__'s default
MAX_SEQUENCE_LENGTH = 512  # FluxPipeline.check_inputs rejects more


@dataclass
class FluxState(FlowMatchState):
    txt_ids: Optional[torch.Tensor] = None  # zeros [text length, 3]: the same for both CFG sides
    img_ids: Optional[torch.Tensor] = None  # [packed latent length, 3]: depends on the image size only


class FluxAdapter(FlowMatchAdapter):
    """`FluxPipeline` (text-to-image) with request batching, step execution and previews.

    `guidance_scale` is the embedded guidance of guidance-distilled checkpoints
    (FLUX.1-dev; per row, default 3.5); checkpoints without guidance embeddings
    (FLUX.1-schnell) reject it. True CFG (`negative_prompt` + `true_cfg_scale` > 1)
    is diffusers' second pass.
    """

    name = "flux"
    pipeline_class = "FluxPipeline"
    cost_reference = {"height": 1024, "width": 1024, "negative_prompt": "", "true_cfg_scale": 4.0}
    inputs = IMAGE_INPUTS + (
        max_sequence_length(default=DEFAULT_MAX_SEQUENCE_LENGTH, high=MAX_SEQUENCE_LENGTH),
        TRUE_CFG_SCALE,  # FluxPipeline.__call__'s default 1.0: no true CFG
        replace(GUIDANCE_SCALE, default=DEFAULT_GUIDANCE_SCALE, batch="row",
                doc="embedded guidance of guidance-distilled checkpoints (FLUX.1-dev), per row"),
        *ALL_CACHE_INPUTS,
    )
    state_class = FluxState
    capabilities = FlowMatchAdapter.capabilities.with_features(
        "mixed_sizes", "first_block", "taylorseer", "sequence_parallel", "cfg_parallel")
    batch_inputs = ("txt_ids", "img_ids")  # one text length and image size per forward (without packing)
    step_key_skips = ("height", "width")  # with mixed_size_batching, sizes share a step batch (mixed_sizes.py)

    def input_specs(self) -> tuple[InputSpec, ...]:
        if self.pipe.transformer.config.guidance_embeds:
            return super().input_specs()
        return replace_spec(super().input_specs(), "guidance_scale",
                            unused="this checkpoint has no guidance embeddings (FLUX.1-schnell)")

    # -- pipeline-specific phases ------------------------------------------------
    def _encode(self, state: FluxState) -> dict[str, TextParts]:
        params = state.params
        sides = {"cond": params.prompt}
        if self.do_cfg(params):
            sides["uncond"] = params.negative_prompt
        text = {}
        for side, prompt in sides.items():
            embeds, pooled, _ = self.pipe.encode_prompt(
                prompt=prompt, prompt_2=None, device=self.device, num_images_per_prompt=params.num_images,
                max_sequence_length=self.text_length(params),
            )
            text[side] = {"embeds": embeds, "pooled": pooled}
        return text

    def _initial_latents(self, state: FluxState) -> torch.Tensor:
        p = state.params
        num_channels_latents = self.pipe.transformer.config.in_channels // 4
        embeds = state.text["cond"]["embeds"]
        dtype = embeds.dtype
        # encode_prompt's text ids, made here so cached embeddings need none: zeros [L, 3] in the encoder's dtype
        state.txt_ids = torch.zeros(embeds.shape[1], 3, device=self.device, dtype=self.pipe.text_encoder.dtype)
        latents, state.img_ids = self.pipe.prepare_latents(
            p.num_images, num_channels_latents, p.height, p.width, dtype, self.device, state.generator)
        return latents

    def _timestep_kwargs(self, state: FluxState) -> dict:
        n = state.params.num_inference_steps
        use_flow_sigmas = self.pipe.scheduler.config.get("use_flow_sigmas", False)
        sigmas = None if use_flow_sigmas else np.linspace(1.0, 1 / n, n)
        return {"sigmas": sigmas, "mu": self._shift(state.latents.shape[1])}

    def _row_inputs(self, states: list[FluxState]) -> dict:
        rows = {"guidance": self._guidance_rows(states)}
        if len({(s.params.height, s.params.width) for s in states}) > 1:  # a ragged batch: image tokens packed
            rows["packing"] = FluxPacking(self.pipe.transformer.pos_embed, states[0].txt_ids,
                                          [s.img_ids for s in states for _ in range(s.num_rows)], self.device)
        else:
            rows.update(txt_ids=states[0].txt_ids, img_ids=states[0].img_ids)
        return rows

    # -- the forwards FlowMatchAdapter._forward chooses from ---------------------------
    def _plain_forward(self, latents, timestep, text, rows, states) -> torch.Tensor:
        return self.pipe.transformer(
            hidden_states=latents,
            timestep=timestep,
            guidance=rows["guidance"],
            pooled_projections=text["pooled"],
            encoder_hidden_states=text["embeds"],
            txt_ids=rows["txt_ids"],
            img_ids=rows["img_ids"],
            return_dict=False,
        )[0]

    def _packed_forward(self, latents, timestep, text, rows) -> torch.Tensor:
        return packed_forward(self.pipe.transformer, latents, timestep, rows["guidance"], text["pooled"],
                              text["embeds"], rows["packing"])

    def _cached_forward(self, latents, timestep, text, rows, states, groups, seer) -> torch.Tensor:
        return cached_forward(self.pipe.transformer, self.loras, latents, timestep, rows["guidance"],
                              text["pooled"], text["embeds"], rows["txt_ids"], rows["img_ids"], groups, seer)

    def _cached_packed_forward(self, latents, timestep, text, rows, groups) -> torch.Tensor:
        return cached_packed_forward(self.pipe.transformer, self.loras, latents, timestep, rows["guidance"],
                                     text["pooled"], text["embeds"], rows["packing"], groups)

    def _unpack(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return self.pipe._unpack_latents(latents, height, width, self.pipe.vae_scale_factor)


ADAPTER = FluxAdapter
