"""Stable Diffusion 3 behind the engine's contracts: `StableDiffusion3Pipeline.__call__` cut into its phases.

The shared skeleton is `FlowMatchAdapter`; this module holds what is SD3's own,
each piece calling the pipeline's helpers:

* text: one `encode_prompt` call (two CLIPs + T5 padded to `max_sequence_length`,
  and with CFG the negative prompt, "" when none is given);
* latents: `prepare_latents` ([N, C, h, w]), kept as tokens [N, h * w, C] (a permutation, so the
  values are diffusers'; `_unpack` restores [N, C, h, w] for the transformer and the VAE); with
  `mixed_size_batching`, rows of different sizes share a step batch, their patch tokens packed,
  each with its own crop of the position table (mixed_sizes.py);
* timesteps: the scheduler's own (no sigmas), `calculate_shift` only with
  `use_dynamic_shifting`;
* transformer: the scheduler's timestep as is (no `/ 1000`); classifier-free
  guidance (`guidance_scale` > 1) as diffusers runs it: one forward of 2B rows,
  negatives first, then `uncond + scale * (cond - uncond)`;
* decode: `/ scaling_factor + shift_factor`, `vae.decode`;
* image-to-image (`StableDiffusion3Img2ImgPipeline`): with an `image`, the request runs the last
  `strength` of its schedule (`get_timesteps`), from the image's VAE latents noised to the first
  of those timesteps (`prepare_latents`: a latent sample, then the noise, from the request's
  generator; `scale_noise` on its own scheduler). The encoded image stays in the request's state.
* inpainting (`StableDiffusion3InpaintPipeline`): with an `image` and a `mask_image` (grayscale, binarized,
  resized to the latents by the pipeline's mask processor), the same start (pure noise at strength 1), and
  after each step the latents outside the mask are the image's latents noised to the next timestep (the
  last step: the image's latents as they are). SD3's transformer has 16 input channels, so, as diffusers
  does with it, the mask only blends: the masked image's latents, which only a 33-channel transformer
  reads, are not computed. The mask and the noise stay in the request's state with the image's latents.
  `padding_mask_crop` is not supported. Decoding adds the VAE's `shift_factor` back as text-to-image and
  image-to-image do (diffusers' inpainting decode leaves it out, though its encode subtracts it).

The text length is shared by every row of a forward (no text mask), so it is in
the keys, with whether CFG is on and its scale; the image size is too, unless
`mixed_size_batching` is on.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Optional

import torch

from engine_lib import interface
from engine_lib.host_copy import to_device
from engine_lib.pipelines.flow_match import (GUIDANCE_SCALE, IMAGE_INPUTS, FlowMatchAdapter, FlowMatchState,
                                             TextParts, max_sequence_length, strength_steps)
from engine_lib.pipelines.sd3.first_block import cached_forward, cached_packed_forward
from engine_lib.pipelines.sd3.mixed_sizes import SD3Packing, packed_forward
from engine_lib.pipelines.sd3.tokens import from_tokens, to_tokens
from engine_lib.pipelines.step_cache import ALL_CACHE_INPUTS
from engine_lib.request import InvalidInputError, SamplingParams
from engine_lib.sched.keys import RequestBatchKey

DEFAULT_GUIDANCE_SCALE = 7.0  # StableDiffusion3Pipeline.__call__'s default
DEFAULT_MAX_SEQUENCE_LENGTH = 256  # StableDiffusion3Pipeline.__call__'s default
MAX_SEQUENCE_LENGTH = 512  # StableDiffusion3Pipeline.check_inputs rejects more

IMAGE = interface.InputSpec("image", "BYTES", "image-to-image: the image to start from (PNG, JPEG or WebP; resized "
                            "to height x width)", content="image", batch="row", pipe_arg="image")
STRENGTH = interface.InputSpec("strength", "FP32", "with an image: how much of the schedule runs (the last "
                               "strength x num_inference_steps steps; 1: all, the image only seeds the noise)",
                               default=1.0, low=0, high=1, batch="row", pipe_arg="strength")
MASK_IMAGE = interface.InputSpec("mask_image", "BYTES", "inpainting, with an image: white repaints, black keeps "
                                 "(grayscale, binarized, resized to height x width)", content="image", batch="row",
                                 pipe_arg="mask_image")


@dataclass
class SD3State(FlowMatchState):
    """An SD3 request between steps; with an input image, its VAE latents too (as tokens, one row per image), and
    with a mask, the mask [N, h * w, 1] and the start noise the image's latents are noised with at each step."""

    image_latents: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    noise: Optional[torch.Tensor] = None


class SD3Adapter(FlowMatchAdapter):
    """`StableDiffusion3Pipeline` (text-to-image), `StableDiffusion3Img2ImgPipeline` (with an `image`) and
    `StableDiffusion3InpaintPipeline` (with a `mask_image` too), with request batching, step execution and previews."""

    name = "sd3"
    pipeline_class = "StableDiffusion3Pipeline"
    state_class = SD3State
    inputs = IMAGE_INPUTS + (
        max_sequence_length(default=DEFAULT_MAX_SEQUENCE_LENGTH, high=MAX_SEQUENCE_LENGTH),
        replace(GUIDANCE_SCALE, default=DEFAULT_GUIDANCE_SCALE, batch="adapter",
                doc="classifier-free guidance scale: > 1 runs the negative_prompt (or \"\") as a second half"),
        IMAGE, STRENGTH, MASK_IMAGE, *ALL_CACHE_INPUTS,
    )
    cfg_kind = "cfg"
    cost_reference = {"height": 1024, "width": 1024, "guidance_scale": 7.0}
    cfg_order = ("uncond", "cond")  # torch.cat([negative_prompt_embeds, prompt_embeds]) in __call__
    capabilities = FlowMatchAdapter.capabilities.with_features("mixed_sizes", "first_block", "taylorseer",
                                                               "image_input")
    step_key_skips = ("height", "width")  # with mixed_size_batching, sizes share a step batch (mixed_sizes.py)

    @property
    def size_multiple(self) -> int:
        return self.pipe.vae_scale_factor * self.pipe.patch_size

    @property
    def max_size(self) -> Optional[int]:
        """The largest height/width the transformer's cropped position embedding covers (None: no limit)."""
        max_patches = self.pipe.transformer.config.pos_embed_max_size
        return max_patches * self.size_multiple if max_patches else None

    # -- image-to-image ------------------------------------------------------------
    def check_inputs(self, params: SamplingParams) -> None:
        super().check_inputs(params)
        if params.image is None and params.mask_image is not None:
            raise InvalidInputError("mask_image", "needs an image: the mask says which part of it to repaint")
        if params.image is None:
            if params.strength != 1.0:
                raise InvalidInputError("strength", "needs an image: without one the request is text-to-image")
        elif self.total_steps(params) < 1:
            raise InvalidInputError("strength", f"{params.strength:g} of {params.num_inference_steps} steps runs "
                                    f"none: at least 1/{params.num_inference_steps} needed")

    def total_steps(self, params: SamplingParams) -> int:
        """The steps that really run: with an image, the last `strength` of the schedule."""
        if params.image is None:
            return int(params.num_inference_steps)
        return strength_steps(params.num_inference_steps, params.strength)

    def request_key(self, params: SamplingParams) -> RequestBatchKey:
        """A request-mode wave runs one step count: the steps that run, not the schedule's length."""
        return replace(super().request_key(params), num_inference_steps=self.total_steps(params))

    def pipe_kwargs(self, params: SamplingParams) -> dict:
        """Text-to-image: `StableDiffusion3Pipeline`'s arguments; with an image, `StableDiffusion3Img2ImgPipeline`'s
        (the decoded PIL image), with a mask too, `StableDiffusion3InpaintPipeline`'s."""
        kwargs = super().pipe_kwargs(params)
        if params.image is None:
            kwargs.pop("strength", None)
        else:
            kwargs["image"] = params.image.image
        if params.mask_image is not None:
            kwargs["mask_image"] = params.mask_image.image
        return kwargs

    @functools.cached_property
    def image_processor(self):
        """`StableDiffusion3Img2ImgPipeline`'s image processor (resize to height x width, then [-1, 1])."""
        from diffusers.image_processor import VaeImageProcessor

        return VaeImageProcessor(vae_scale_factor=self.pipe.vae_scale_factor,
                                 vae_latent_channels=self.latent_channels)

    def _image_latents(self, state: SD3State, dtype: torch.dtype) -> torch.Tensor:
        """The input image's VAE latents [N, C, h, w], sampled with the request's generator, as `prepare_latents`
        encodes it (one sample, repeated for each image of the request)."""
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3_img2img import retrieve_latents

        p, vae = state.params, self.pipe.vae
        image = self.image_processor.preprocess(p.image.image, height=p.height, width=p.width)
        latents = retrieve_latents(vae.encode(to_device(image, self.device, dtype)), generator=state.generator)
        latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
        return torch.cat([latents] * p.num_images)

    @functools.cached_property
    def mask_processor(self):
        """`StableDiffusion3InpaintPipeline`'s mask processor: grayscale, binarized at 0.5, in [0, 1]."""
        from diffusers.image_processor import VaeImageProcessor

        return VaeImageProcessor(vae_scale_factor=self.pipe.vae_scale_factor, vae_latent_channels=self.latent_channels,
                                 do_normalize=False, do_binarize=True, do_convert_grayscale=True)

    def _mask(self, params: SamplingParams, dtype: torch.dtype) -> torch.Tensor:
        """The mask at the latents' size [N, 1, h, w], as `prepare_mask_latents` resizes it (nearest)."""
        vae = self.pipe.vae_scale_factor
        mask = self.mask_processor.preprocess(params.mask_image.image, height=params.height, width=params.width)
        mask = torch.nn.functional.interpolate(mask, size=(params.height // vae, params.width // vae))
        return mask.to(self.device, dtype).repeat(params.num_images, 1, 1, 1)

    # -- pipeline-specific phases ------------------------------------------------
    def _encode(self, state: FlowMatchState) -> dict[str, TextParts]:
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

    def _initial_latents(self, state: SD3State) -> torch.Tensor:
        from diffusers.utils.torch_utils import randn_tensor

        p = state.params
        dtype = state.text["cond"]["embeds"].dtype
        if p.image is None:
            return to_tokens(self.pipe.prepare_latents(p.num_images, self.pipe.transformer.config.in_channels,
                                                       p.height, p.width, dtype, self.device, state.generator))
        self._set_schedule(state)  # the latents start at its first timestep
        image_latents = self._image_latents(state, dtype)
        state.image_latents = to_tokens(image_latents)
        noise = randn_tensor(image_latents.shape, generator=state.generator, device=self.device, dtype=dtype)
        if p.mask_image is not None:
            state.mask, state.noise = to_tokens(self._mask(p, dtype)), to_tokens(noise)
            if p.strength == 1.0:  # the inpainting pipeline starts from the noise alone
                return state.noise.clone()  # (the noise itself stays as it is)
        first = state.schedule.timestep(0).expand(p.num_images)
        return to_tokens(state.scheduler.scale_noise(image_latents, first, noise).to(dtype))

    @torch.inference_mode()
    def step_scheduler(self, state: SD3State, noise_pred: torch.Tensor) -> None:
        super().step_scheduler(state, noise_pred)
        self._keep_unmasked([state])

    @torch.inference_mode()
    def step_batch(self, input_batch, states: list[SD3State], prediction: torch.Tensor) -> bool:
        if not super().step_batch(input_batch, states, prediction):
            return False
        self._keep_unmasked(states)
        return True

    def _keep_unmasked(self, states: list[SD3State]) -> None:
        """After a step, each inpainting request's latents outside its mask become its image's latents noised to
        the next timestep (after the last step, as they are), as diffusers blends them. In place: after a
        batched step a request's latents are rows of the batch's, which stay the batch's."""
        for state in states:
            if state.mask is None:
                continue
            original = state.image_latents
            if state.step_index < state.num_steps:  # the scheduler stands at the next timestep's sigma
                next_timestep = state.schedule.timestep(state.step_index).reshape(1)
                original = state.scheduler.scale_noise(original, next_timestep, state.noise)
            state.latents.copy_((1 - state.mask) * original + state.mask * state.latents)

    def _timestep_kwargs(self, state: FlowMatchState) -> dict:
        if not self.pipe.scheduler.config.get("use_dynamic_shifting", None):
            return {}
        p = state.params
        return {"mu": self._shift(p.height // self.size_multiple * (p.width // self.size_multiple),
                                  max_shift_default=1.16)}

    def _model_timestep(self, timesteps: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return timesteps  # SD3's transformer takes the scheduler's timesteps as they are

    def _row_inputs(self, states: list[FlowMatchState]) -> dict:
        if len({(s.params.height, s.params.width) for s in states}) == 1:
            return {}
        vae = self.pipe.vae_scale_factor  # a ragged batch: patch tokens packed
        return {"packing": SD3Packing([(s.params.height // vae, s.params.width // vae) for s in states
                                       for _ in range(s.num_rows)], self.pipe.patch_size, self.device)}

    # -- the forwards FlowMatchAdapter._forward chooses from ---------------------------
    def _plain_forward(self, latents, timestep, text, rows, states) -> torch.Tensor:
        """diffusers' forward on [N, C, h, w] latents, its prediction back as tokens."""
        return to_tokens(self.pipe.transformer(
            hidden_states=self._spatial(latents, states),
            timestep=timestep,
            encoder_hidden_states=text["embeds"],
            pooled_projections=text["pooled"],
            joint_attention_kwargs=None,
            return_dict=False,
        )[0])

    def _packed_forward(self, latents, timestep, text, rows) -> torch.Tensor:
        return packed_forward(self.pipe.transformer, latents, timestep, text["pooled"], text["embeds"],
                              rows["packing"], self.loras)

    def _cached_forward(self, latents, timestep, text, rows, states, groups, seer) -> torch.Tensor:
        return to_tokens(cached_forward(self.pipe.transformer, self.loras, self._spatial(latents, states), timestep,
                                        text["pooled"], text["embeds"], groups, seer))

    def _cached_packed_forward(self, latents, timestep, text, rows, groups) -> torch.Tensor:
        return cached_packed_forward(self.pipe.transformer, self.loras, latents, timestep, text["pooled"],
                                     text["embeds"], rows["packing"], groups)

    def _spatial(self, latents: torch.Tensor, states: list[SD3State]) -> torch.Tensor:
        """Token latents of rows of one size as the transformer takes them: [N, C, h, w]."""
        return self._unpack(latents, states[0].params.height, states[0].params.width)

    def _image_tokens(self, state: SD3State) -> int:
        """Its patches (the latents are kept one token per latent pixel)."""
        patch = self.size_multiple
        return state.params.height // patch * (state.params.width // patch)

    def _unpack(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        vae = self.pipe.vae_scale_factor
        return from_tokens(latents, height // vae, width // vae)


ADAPTER = SD3Adapter
