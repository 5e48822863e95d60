"""Flux behind the engine's contracts: `FluxPipeline.__call__` cut into its phases.

The shared skeleton is `FlowMatchAdapter`; this module holds what is Flux's own,
each piece calling the pipeline's helpers:

* text: `encode_prompt` (CLIP pooled + T5 padded to `max_sequence_length`, and
  the negative prompt for true CFG); `txt_ids` are shared by the whole batch;
* latents: `prepare_latents` (packed 2x2) with `img_ids`, shared by the batch;
* timesteps: sigmas `linspace(1, 1/n, n)`, `calculate_shift` on the packed sequence length;
* transformer: timestep in the latents' dtype `/ 1000`, embedded guidance per
  row (float32, as the pipeline builds it), true CFG without a rescale;
* decode: `_unpack_latents`, `/ scaling_factor + shift_factor`, `vae.decode`.

Shared `txt_ids`/`img_ids` mean one forward holds one image size and one text
length: both are in the keys (height/width, and `key_fields`).
"""

from __future__ import annotations

import numpy as np
import torch

from engine_lib.pipelines.base import COMMON_INPUTS, StepRequestState
from engine_lib.pipelines.flow_match import FlowMatchAdapter, TextParts
from engine_lib.request import InvalidInputError, SamplingParams

DEFAULT_GUIDANCE_SCALE = 3.5  # FluxPipeline.__call__'s default
DEFAULT_MAX_SEQUENCE_LENGTH = 512  # FluxPipeline.__call__'s default
MAX_SEQUENCE_LENGTH = 512  # FluxPipeline.check_inputs rejects more


class FluxAdapter(FlowMatchAdapter):
    """`FluxPipeline` (text-to-image) with request batching, step execution and previews.

    `guidance_scale` is the embedded guidance of guidance-distilled checkpoints
    (FLUX.1-dev; per row, default 3.5); checkpoints without guidance embeddings
    (FLUX.1-schnell) reject it. True CFG (`negative_prompt` + `true_cfg_scale` > 1)
    is diffusers' second pass.
    """

    name = "flux"
    pipeline_class = "FluxPipeline"
    supports_request_batch = True
    supports_step_execution = True
    supports_previews = True
    supported_inputs = COMMON_INPUTS | {"negative_prompt", "true_cfg_scale", "guidance_scale", "preview_interval",
                                        "max_sequence_length"}
    cfg_kind = "true_cfg"
    per_row_guidance = True
    default_inputs = {"guidance_scale": DEFAULT_GUIDANCE_SCALE}
    default_max_sequence_length = DEFAULT_MAX_SEQUENCE_LENGTH
    max_max_sequence_length = MAX_SEQUENCE_LENGTH

    @property
    def size_multiple(self) -> int:
        # The VAE downsamples by vae_scale_factor, then latents are packed in 2x2 patches.
        return self.pipe.vae_scale_factor * 2

    def validate(self, params: SamplingParams) -> None:
        super().validate(params)
        if not self.pipe.transformer.config.guidance_embeds and params.guidance_scale is not None:
            raise InvalidInputError("guidance_scale", f"{params.guidance_scale}: this checkpoint has no guidance "
                                    "embeddings and does not use it")

    def key_fields(self, params: SamplingParams) -> tuple:
        # txt_ids ([text length, 3]) are one tensor for the whole forward.
        return (("text_length", self.text_length(params)),)

    # -- pipeline-specific phases ------------------------------------------------
    def _encode(self, state: StepRequestState) -> dict[str, TextParts]:
        params = state.params
        sides = {"cond": params.prompt}
        if params.do_true_cfg:
            sides["uncond"] = params.negative_prompt
        text = {}
        for side, prompt in sides.items():
            embeds, pooled, txt_ids = self.pipe.encode_prompt(
                prompt=prompt, prompt_2=None, device=self.device, num_images_per_prompt=params.num_images,
                max_sequence_length=self.text_length(params),
            )
            text[side] = {"embeds": embeds, "pooled": pooled}
            state.extra["txt_ids"] = txt_ids  # zeros [text length, 3]: the same for both sides
        return text

    def _initial_latents(self, state: StepRequestState) -> torch.Tensor:
        p = state.params
        num_channels_latents = self.pipe.transformer.config.in_channels // 4
        dtype = state.extra["text"]["cond"]["embeds"].dtype
        latents, state.extra["img_ids"] = self.pipe.prepare_latents(
            p.num_images, num_channels_latents, p.height, p.width, dtype, self.device, state.generator)
        return latents

    def _timestep_kwargs(self, state: StepRequestState) -> dict:
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = self.pipe.scheduler.config
        n = state.params.num_inference_steps
        sigmas = None if config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / n, n)
        mu = calculate_shift(
            state.latents.shape[1],
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        return {"sigmas": sigmas, "mu": mu}

    def _row_inputs(self, states: list[StepRequestState]) -> dict:
        return {"guidance": self._guidance_rows(states, default=DEFAULT_GUIDANCE_SCALE)}

    def _transformer(self, latents, timestep, text, rows, states) -> torch.Tensor:
        img_ids = states[0].extra["img_ids"]
        assert all(s.extra["img_ids"].shape == img_ids.shape for s in states), "one image size per batch (keys)"
        return self.pipe.transformer(
            hidden_states=latents,
            timestep=timestep,
            guidance=rows["guidance"],
            pooled_projections=text["pooled"],
            encoder_hidden_states=text["embeds"],
            txt_ids=states[0].extra["txt_ids"],
            img_ids=img_ids,
            joint_attention_kwargs={},
            return_dict=False,
        )[0]

    def _unpack(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return self.pipe._unpack_latents(latents, height, width, self.pipe.vae_scale_factor)
