"""Stable Diffusion 3 behind the engine's contracts: `StableDiffusion3Pipeline.__call__` cut into its phases.

The shared skeleton is `FlowMatchAdapter`; this module holds what is SD3's own,
each piece calling the pipeline's helpers:

* text: one `encode_prompt` call (two CLIPs + T5 padded to `max_sequence_length`,
  and with CFG the negative prompt, "" when none is given);
* latents: `prepare_latents` ([N, C, h, w], no packing);
* timesteps: the scheduler's own (no sigmas), `calculate_shift` only with
  `use_dynamic_shifting`;
* transformer: the scheduler's timestep as is (no `/ 1000`); classifier-free
  guidance (`guidance_scale` > 1) as diffusers runs it: one forward of 2B rows,
  negatives first, then `uncond + scale * (cond - uncond)`;
* decode: `/ scaling_factor + shift_factor`, `vae.decode`.

The text length is shared by every row of a forward (no text mask), so it is in
the keys, with whether CFG is on and its scale.
"""

from __future__ import annotations

import torch

from engine_lib.pipelines.base import COMMON_INPUTS, StepRequestState
from engine_lib.pipelines.flow_match import FlowMatchAdapter, TextParts
from engine_lib.request import InvalidInputError, SamplingParams

DEFAULT_GUIDANCE_SCALE = 7.0  # StableDiffusion3Pipeline.__call__'s default
DEFAULT_MAX_SEQUENCE_LENGTH = 256  # StableDiffusion3Pipeline.__call__'s default
MAX_SEQUENCE_LENGTH = 512  # StableDiffusion3Pipeline.check_inputs rejects more


class SD3Adapter(FlowMatchAdapter):
    """`StableDiffusion3Pipeline` (text-to-image) with request batching, step execution and previews."""

    name = "sd3"
    pipeline_class = "StableDiffusion3Pipeline"
    supports_request_batch = True
    supports_step_execution = True
    supports_previews = True
    supported_inputs = COMMON_INPUTS | {"negative_prompt", "guidance_scale", "preview_interval", "max_sequence_length"}
    cfg_kind = "cfg"
    default_inputs = {"guidance_scale": DEFAULT_GUIDANCE_SCALE}
    cfg_order = ("uncond", "cond")  # torch.cat([negative_prompt_embeds, prompt_embeds]) in __call__
    default_max_sequence_length = DEFAULT_MAX_SEQUENCE_LENGTH
    max_max_sequence_length = MAX_SEQUENCE_LENGTH

    @property
    def size_multiple(self) -> int:
        return self.pipe.vae_scale_factor * self.pipe.patch_size

    @property
    def max_size(self) -> int:
        """The largest height/width the transformer's cropped position embedding covers (0: no limit)."""
        max_patches = self.pipe.transformer.config.pos_embed_max_size
        return 0 if not max_patches else max_patches * self.size_multiple

    def validate(self, params: SamplingParams) -> None:
        super().validate(params)
        if self.max_size:
            for name in ("height", "width"):
                value = getattr(params, name)
                if value > self.max_size:
                    raise InvalidInputError(name, f"{value} is above {self.max_size}, the largest size this "
                                            "transformer's position embedding covers")

    def guidance_scale(self, params: SamplingParams) -> float:
        return float(DEFAULT_GUIDANCE_SCALE if params.guidance_scale is None else params.guidance_scale)

    def do_cfg(self, params: SamplingParams) -> bool:
        return self.guidance_scale(params) > 1  # the pipeline's do_classifier_free_guidance

    def cfg_scale(self, params: SamplingParams) -> float:
        return self.guidance_scale(params)

    def key_fields(self, params: SamplingParams) -> tuple:
        # One text length per forward (no text mask); CFG on/off and its scale shape the forward.
        cfg = self.do_cfg(params)
        return (("text_length", self.text_length(params)), ("cfg", cfg),
                ("cfg_scale", self.guidance_scale(params) if cfg else None))

    # -- pipeline-specific phases ------------------------------------------------
    def _encode(self, state: StepRequestState) -> dict[str, TextParts]:
        p = state.params
        do_cfg = self.do_cfg(p)
        embeds, negative_embeds, pooled, negative_pooled = self.pipe.encode_prompt(
            prompt=p.prompt, prompt_2=None, prompt_3=None, device=self.device, num_images_per_prompt=p.num_images,
            do_classifier_free_guidance=do_cfg, negative_prompt=p.negative_prompt,
            max_sequence_length=self.text_length(p),
        )
        text = {"cond": {"embeds": embeds, "pooled": pooled}}
        if do_cfg:
            text["uncond"] = {"embeds": negative_embeds, "pooled": negative_pooled}
        return text

    def _initial_latents(self, state: StepRequestState) -> torch.Tensor:
        p = state.params
        dtype = state.extra["text"]["cond"]["embeds"].dtype
        return self.pipe.prepare_latents(p.num_images, self.pipe.transformer.config.in_channels, p.height, p.width,
                                         dtype, self.device, state.generator)

    def _timestep_kwargs(self, state: StepRequestState) -> dict:
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

        config = self.pipe.scheduler.config
        if not config.get("use_dynamic_shifting", None):
            return {}
        _, _, height, width = state.latents.shape
        patch = self.pipe.transformer.config.patch_size
        mu = calculate_shift(
            (height // patch) * (width // patch),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.16),
        )
        return {"mu": mu}

    def _model_timestep(self, timesteps: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return timesteps  # SD3's transformer takes the scheduler's timesteps as they are

    def _transformer(self, latents, timestep, text, rows, states) -> torch.Tensor:
        return self.pipe.transformer(
            hidden_states=latents,
            timestep=timestep,
            encoder_hidden_states=text["embeds"],
            pooled_projections=text["pooled"],
            joint_attention_kwargs=None,
            return_dict=False,
        )[0]
