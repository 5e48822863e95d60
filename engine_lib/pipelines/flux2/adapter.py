"""FLUX.2 [klein] behind the engine's contracts: `Flux2KleinPipeline.__call__` (text-to-image) cut into its phases.

The shared skeleton is `FlowMatchAdapter`; this module holds what is FLUX.2's own,
each piece calling the pipeline's helpers:

* text: `encode_prompt` (a Qwen3 chat turn padded to `max_sequence_length`, hidden states
  9, 18 and 27 side by side); with CFG the negative side is always `""`, as in diffusers;
* latents: `prepare_latents` (2x2-patchified, packed to tokens) with their 4-axis ids, and
  `_prepare_text_ids`; the ids are the batch's (the transformer reads its first row's);
* timesteps: sigmas `linspace(1, 1/n, n)`, `compute_empirical_mu` on the token count and steps;
* transformer: timestep in the latents' dtype `/ 1000`, no guidance embedding; CFG
  `uncond + scale * (cond - uncond)` when `guidance_scale > 1` on a checkpoint that is not
  step-distilled (`is_distilled` in its model_index.json);
* decode: `_unpack_latents_with_ids`, the VAE's batch-norm de-normalisation, `_unpatchify_latents`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch

from engine_lib.interface import InputSpec, replace_spec
from engine_lib.pipelines.flow_match import (GUIDANCE_SCALE, IMAGE_INPUTS, FlowMatchAdapter, FlowMatchState,
                                             TextParts, max_sequence_length)
from engine_lib.request import SamplingParams

DEFAULT_GUIDANCE_SCALE = 4.0  # Flux2KleinPipeline.__call__'s default
DEFAULT_MAX_SEQUENCE_LENGTH = 512  # Flux2KleinPipeline.__call__'s default
MAX_SEQUENCE_LENGTH = 512  # the pipeline's tokenizer_max_length


@dataclass
class Flux2State(FlowMatchState):
    txt_ids: Optional[torch.Tensor] = None  # [N, text length, 4]: the same for both CFG sides
    img_ids: Optional[torch.Tensor] = None  # [N, tokens, 4]: depends on the image size only


class Flux2Adapter(FlowMatchAdapter):
    """`Flux2KleinPipeline` (text-to-image) with request batching, step execution and previews.

    The pipeline takes no negative prompt: CFG runs the empty one. A step-distilled checkpoint
    (`is_distilled`) runs without CFG and refuses `guidance_scale`, which diffusers would ignore.
    """

    name = "flux2"
    pipeline_class = "Flux2KleinPipeline"
    cost_reference = {"height": 1024, "width": 1024, "guidance_scale": DEFAULT_GUIDANCE_SCALE}
    # Flux2KleinPipeline takes no negative prompt (CFG runs the empty one): not declared, so refused by name
    inputs = tuple(spec for spec in IMAGE_INPUTS if spec.name != "negative_prompt") + (
        max_sequence_length(default=DEFAULT_MAX_SEQUENCE_LENGTH, high=MAX_SEQUENCE_LENGTH),
        replace(GUIDANCE_SCALE, default=DEFAULT_GUIDANCE_SCALE, batch="adapter",
                doc="classifier-free guidance scale: > 1 runs the empty prompt as a second pass (not on "
                    "step-distilled checkpoints)"),
    )
    cfg_kind = "cfg"
    state_class = Flux2State
    batch_inputs = ("txt_ids", "img_ids")  # one text length and image size per forward
    # CFG is on by default and diffusers runs its halves as two forwards: cfg_batching=false is bitwise its output
    diffusers_cfg_batching = False

    @property
    def is_distilled(self) -> bool:
        return bool(getattr(self.pipe.config, "is_distilled", False))

    def input_specs(self) -> tuple[InputSpec, ...]:
        if not self.is_distilled:
            return super().input_specs()
        return replace_spec(super().input_specs(), "guidance_scale",
                            unused="this checkpoint is step-distilled (is_distilled): it runs without CFG")

    def do_cfg(self, params: SamplingParams) -> bool:
        """`Flux2KleinPipeline.do_classifier_free_guidance`."""
        return not self.is_distilled and float(params.guidance_scale) > 1

    def _text_key(self, params: SamplingParams) -> tuple:
        """What `_encode` reads (the base's key, with no negative prompt)."""
        return (self.name, params.prompt, self.do_cfg(params), self.text_length(params), params.num_images,
                self.row_lora(params))

    # -- pipeline-specific phases ------------------------------------------------
    def _encode(self, state: Flux2State) -> dict[str, TextParts]:
        params = state.params
        sides = {"cond": params.prompt}
        if self.do_cfg(params):
            sides["uncond"] = ""
        text = {}
        for side, prompt in sides.items():
            embeds, _ = self.pipe.encode_prompt(prompt=prompt, device=self.device,
                                                num_images_per_prompt=params.num_images,
                                                max_sequence_length=self.text_length(params))
            text[side] = {"embeds": embeds}
        return text

    def _initial_latents(self, state: Flux2State) -> torch.Tensor:
        p = state.params
        embeds = state.text["cond"]["embeds"]
        # encode_prompt's text ids, made here so cached embeddings need none
        state.txt_ids = self.pipe._prepare_text_ids(embeds).to(self.device)
        latents, state.img_ids = self.pipe.prepare_latents(
            p.num_images, self.pipe.transformer.config.in_channels // 4, p.height, p.width, embeds.dtype,
            self.device, state.generator)
        return latents

    def _timestep_kwargs(self, state: Flux2State) -> dict:
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        n = state.params.num_inference_steps
        use_flow_sigmas = self.pipe.scheduler.config.get("use_flow_sigmas", False)
        sigmas = None if use_flow_sigmas else np.linspace(1.0, 1 / n, n)
        return {"sigmas": sigmas, "mu": compute_empirical_mu(image_seq_len=state.latents.shape[1], num_steps=n)}

    def _row_inputs(self, states: list[Flux2State]) -> dict:
        return {"txt_ids": states[0].txt_ids, "img_ids": states[0].img_ids}

    def _plain_forward(self, latents, timestep, text, rows, states) -> torch.Tensor:
        return self.pipe.transformer(
            hidden_states=latents.to(self.pipe.transformer.dtype),
            timestep=timestep,
            guidance=None,
            encoder_hidden_states=text["embeds"],
            txt_ids=rows["txt_ids"],
            img_ids=rows["img_ids"],
            return_dict=False,
        )[0]

    @property
    def latent_channels(self) -> int:
        return 4 * int(self.pipe.vae.config.latent_channels)  # the patchified space the transformer denoises

    def _unpack(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Tokens -> patchified latents [N, 4C, h, w], scattered by their ids as the pipeline does."""
        pipe = self.pipe
        h, w = height // (pipe.vae_scale_factor * 2), width // (pipe.vae_scale_factor * 2)
        ids = pipe._prepare_latent_ids(torch.empty(latents.shape[0], 0, h, w)).to(latents.device)
        return pipe._unpack_latents_with_ids(latents, ids, h, w)

    def _vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        """The pipeline's batch-norm de-normalisation, then unpatchify and decode."""
        vae = self.pipe.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device,
                                                                                              latents.dtype)
        latents = self.pipe._unpatchify_latents(latents * std + mean)
        return vae.decode(latents.to(vae.dtype), return_dict=False)[0]


ADAPTER = Flux2Adapter
