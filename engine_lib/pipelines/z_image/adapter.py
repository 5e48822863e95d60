"""Z-Image and Z-Image-Turbo behind the engine's contracts: `ZImagePipeline.__call__` cut into its phases.

The shared skeleton is `FlowMatchAdapter`; this module holds what is Z-Image's own,
each piece calling the pipeline's helpers:

* text: `encode_prompt` (a Qwen3 chat turn, its second-to-last hidden state, only the
  prompt's real tokens); prompts of different lengths share a forward, as the transformer
  takes a list of captions and pads them itself;
* latents: `prepare_latents` in float32, [N, C, h, w], not packed;
* timesteps: `get_default_z_image_sigmas` (`linspace(1, 1/n, n)`) and `calculate_shift`,
  on the checkpoint's scheduler config (Turbo's: a fixed shift of 3);
* transformer: lists of [C, 1, h, w] latents and captions, timestep `(1000 - t) / 1000`,
  CFG `cond + scale * (cond - uncond)` when `guidance_scale > 0`, the prediction negated;
* decode: `/ scaling_factor + shift_factor`, `vae.decode`.

Z-Image-Turbo is called with 8 steps and `guidance_scale=0` (diffusers' example for it); the
model's `default_num_inference_steps` and `default_guidance_scale` parameters set those defaults
(model_repository/z_image/config.pbtxt); without them a request gets `ZImagePipeline.__call__`'s
guidance 5.0 (and the engine's default step count).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from engine_lib.pipelines.flow_match import (GUIDANCE_SCALE, IMAGE_INPUTS, FlowMatchAdapter, FlowMatchState,
                                             TextParts, max_sequence_length)
from engine_lib.request import SamplingParams

DEFAULT_GUIDANCE_SCALE = 5.0  # ZImagePipeline.__call__'s default (Turbo is called with 0.0)
DEFAULT_MAX_SEQUENCE_LENGTH = 512  # ZImagePipeline.__call__'s default
MAX_SEQUENCE_LENGTH = 1024  # our limit: the pipeline checks none; the release's captions were trained at 512


class ZImageAdapter(FlowMatchAdapter):
    """`ZImagePipeline` (text-to-image) with request batching, step execution and previews."""

    name = "z_image"
    pipeline_class = "ZImagePipeline"
    cost_reference = {"height": 1024, "width": 1024, "guidance_scale": DEFAULT_GUIDANCE_SCALE}
    inputs = IMAGE_INPUTS + (
        max_sequence_length(default=DEFAULT_MAX_SEQUENCE_LENGTH, high=MAX_SEQUENCE_LENGTH),
        # No declared default, so that the model's `default_guidance_scale` parameter can set Turbo's 0
        # (absent there too: the pipeline's own 5.0, see cfg_scale).
        replace(GUIDANCE_SCALE, batch="adapter",
                doc="classifier-free guidance scale: > 0 runs the negative_prompt (or \"\") as a second half "
                    "(absent: the model's default_guidance_scale, else 5.0; Z-Image-Turbo: 0)"),
    )
    cfg_kind = "cfg"
    pads_text = True  # the transformer takes captions of any lengths (a list) and masks their padding

    def cfg_scale(self, params: SamplingParams) -> float:
        """The request's `guidance_scale`, or where it and the model's default are unset the pipeline's own."""
        return DEFAULT_GUIDANCE_SCALE if params.guidance_scale is None else float(params.guidance_scale)

    def do_cfg(self, params: SamplingParams) -> bool:
        """`ZImagePipeline.do_classifier_free_guidance`: any positive scale (its formula adds to the cond)."""
        return self.cfg_scale(params) > 0

    def key_fields(self, params: SamplingParams) -> tuple:
        """CFG and its scale, and the LoRA: Z-Image's embedders see every row's tokens concatenated ([tokens, D]),
        where a LoRA cannot be given to some rows only, so one forward holds one LoRA (and scale)."""
        return super().key_fields(params) + (("lora", self.row_lora(params)),)

    # -- pipeline-specific phases ------------------------------------------------
    def _encode(self, state: FlowMatchState) -> dict[str, TextParts]:
        params = state.params
        sides = {"cond": params.prompt}
        if self.do_cfg(params):
            sides["uncond"] = params.negative_prompt or ""
        text = {}
        for side, prompt in sides.items():
            (embeds,), _ = self.pipe.encode_prompt([prompt], device=self.device, do_classifier_free_guidance=False,
                                                   max_sequence_length=self.text_length(params))
            text[side] = {"embeds": embeds.unsqueeze(0).repeat(params.num_images, 1, 1)}
        return text

    def _initial_latents(self, state: FlowMatchState) -> torch.Tensor:
        p = state.params
        return self.pipe.prepare_latents(p.num_images, self.pipe.transformer.in_channels, p.height, p.width,
                                         torch.float32, self.device, state.generator)

    def _timestep_kwargs(self, state: FlowMatchState) -> dict:
        from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

        latents = state.latents
        image_seq_len = (latents.shape[2] // 2) * (latents.shape[3] // 2)
        return {"sigmas": get_default_z_image_sigmas(state.params.num_inference_steps),
                "mu": self._shift(image_seq_len)}

    def _model_timestep(self, timesteps: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """Z-Image's transformer counts time the other way: `(1000 - t) / 1000`, in the scheduler's float32."""
        return (1000 - timesteps) / 1000

    def _plain_forward(self, latents, timestep, text, rows, states) -> torch.Tensor:
        """diffusers' forward on lists (one latent and one caption per row), the prediction negated as the
        pipeline negates it before `scheduler.step` (negation is exact, so CFG may combine negated halves)."""
        transformer = self.pipe.transformer
        images = list(latents.to(transformer.dtype).unsqueeze(2).unbind(0))
        loras = {self.row_lora(s.params) for s in states}
        assert len(loras) == 1, "one LoRA per forward (key_fields)"
        # that LoRA as a plan of one row, which applies to every row a layer sees
        with self.loras.rows(list(loras)):
            out = transformer(images, timestep, _captions(text), return_dict=False)[0]
        return -torch.stack([row.float() for row in out]).squeeze(2)

    def _combine_cfg(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """`ZImagePipeline`'s guidance: `pos + scale * (pos - neg)`."""
        return cond + scale * (cond - uncond)

    def _vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        return super()._vae_decode(latents.to(self.pipe.vae.dtype))


def _captions(text: TextParts) -> list[torch.Tensor]:
    """Each row's caption features without padding ([L_i, D]), as `encode_prompt` returns them."""
    embeds, mask = text["embeds"], text.get("mask")
    if mask is None:
        return list(embeds.unbind(0))
    return [row[keep.bool()] for row, keep in zip(embeds, mask)]


ADAPTER = ZImageAdapter
