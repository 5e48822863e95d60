"""Qwen-Image behind the engine's contracts: `QwenImagePipeline.__call__` cut into its phases.

The phases keep diffusers' order and call the pipeline's own helpers, so every
mode produces what `pipe(...)` produces for the same seed:

* `prepare_encode`: `encode_prompt` (and the negative prompt for true CFG),
  `prepare_latents` with the request's own generator, `calculate_shift` +
  `retrieve_timesteps` on the request's own copy of the scheduler.
* `denoise_step`: one transformer forward over every row of the batch (each row
  with its own timestep; prompt embeddings right-padded with a mask), plus the
  true-CFG combination with diffusers' norm rescale.
* `step_scheduler`: the request's scheduler copy steps its latents.
* `post_decode`: `_unpack_latents`, de-normalise, one `vae.decode` per image size,
  `image_processor.postprocess`, then uint8 as `numpy_to_pil` rounds.

`forward` (request batch) runs the same four methods to completion, so the two
modes cannot drift apart.
"""

from __future__ import annotations

import copy
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from engine_lib.pipelines.base import DiffusionRequestBatch, InputBatch, PipelineAdapter, StepRequestState
from engine_lib.request import InvalidInputError, SamplingParams

DEFAULT_MAX_SEQUENCE_LENGTH = 512  # QwenImagePipeline.__call__'s default
MAX_SEQUENCE_LENGTH = 1024  # QwenImagePipeline.check_inputs rejects more


def to_uint8(images: np.ndarray) -> np.ndarray:
    """Float images in [0, 1] to uint8, rounding exactly as diffusers' `numpy_to_pil`."""
    return (images * 255).round().astype("uint8")


class QwenImageAdapter(PipelineAdapter):
    """`QwenImagePipeline` (text-to-image) with request batching, step execution and previews.

    Options: `cfg_batching` (default True): run the CFG cond and uncond passes as
    one forward of 2B rows; False runs them as two forwards, as diffusers does.
    """

    name = "qwen_image"
    supports_request_batch = True
    supports_step_execution = True
    supports_previews = True

    def __init__(self, pipe, device: torch.device, dtype: torch.dtype, options: Optional[dict] = None):
        super().__init__(pipe, device, dtype, options)
        self.cfg_batching = bool(self.options.get("cfg_batching", True))
        self._preview_weights: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    # -- loading and limits --------------------------------------------------
    @classmethod
    def load(cls, model_path: str, device: torch.device, dtype: torch.dtype,
             options: Optional[dict] = None) -> "QwenImageAdapter":
        from diffusers import QwenImagePipeline

        pipe = QwenImagePipeline.from_pretrained(str(model_path), dtype=dtype)  # diffusers 0.42: torch_dtype is deprecated
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        return cls(pipe, torch.device(device), dtype, options)

    @property
    def size_multiple(self) -> int:
        # The VAE downsamples by vae_scale_factor, then latents are packed in 2x2 patches.
        return self.pipe.vae_scale_factor * 2

    def validate(self, params: SamplingParams) -> None:
        super().validate(params)
        if params.num_inference_steps < 2:
            raise InvalidInputError(
                "num_inference_steps",
                f"{params.num_inference_steps} must be >= 2 (Qwen-Image's shift_terminal schedule "
                "gives NaN sigmas for a single step)",
            )
        if params.num_images < 1:
            raise InvalidInputError("num_images", f"{params.num_images} must be >= 1")
        msl = params.max_sequence_length
        if msl is not None and not 1 <= msl <= MAX_SEQUENCE_LENGTH:
            raise InvalidInputError("max_sequence_length", f"{msl} must be in [1, {MAX_SEQUENCE_LENGTH}]")
        if self.pipe.transformer.config.guidance_embeds and params.guidance_scale is None:
            raise InvalidInputError("guidance_scale", "is required by this guidance-distilled model")
        if params.num_frames is not None:
            raise InvalidInputError("num_frames", f"{params.num_frames}: qwen_image makes images; leave it unset")
        if params.lora_name:
            raise InvalidInputError("lora_name", f"{params.lora_name!r}: qwen_image has no LoRAs loaded")

    # -- request batch -------------------------------------------------------
    def forward(self, batch: DiffusionRequestBatch) -> list[np.ndarray]:
        """Run whole requests through the step methods in one fused loop; one uint8 array per request."""
        return self.post_decode(self.denoise_requests(batch))

    def denoise_requests(self, batch: DiffusionRequestBatch) -> list[StepRequestState]:
        """prepare_encode every request, then batched denoise steps until all are done (no decode)."""
        states = [StepRequestState(r.request_id, r.params) for r in batch.requests]
        for state in states:
            self.prepare_encode(state)
        active, input_batch = states, None
        while active:
            input_batch = InputBatch.gather(active, previous=input_batch)
            noise_pred = self.denoise_step(input_batch, states=active)
            for state, rows in zip(active, input_batch.split(noise_pred)):
                self.step_scheduler(state, rows)
            active = [s for s in active if not s.denoise_completed]
        return states

    # -- step execution ------------------------------------------------------
    @torch.inference_mode()
    def prepare_encode(self, state: StepRequestState) -> None:
        """Encode prompts, draw the request's latents, and give it its own scheduler with its timesteps."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

        pipe, p = self.pipe, state.params
        msl = p.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH
        embeds, mask = pipe.encode_prompt(p.prompt, device=self.device, num_images_per_prompt=p.num_images,
                                          max_sequence_length=msl)
        state.extra["prompt_embeds"], state.extra["prompt_embeds_mask"] = embeds, mask
        if p.do_true_cfg:
            neg, neg_mask = pipe.encode_prompt(p.negative_prompt, device=self.device,
                                               num_images_per_prompt=p.num_images, max_sequence_length=msl)
            state.extra["negative_prompt_embeds"], state.extra["negative_prompt_embeds_mask"] = neg, neg_mask

        state.generator = torch.Generator(device=self.device).manual_seed(int(p.seed))
        num_channels_latents = pipe.transformer.config.in_channels // 4
        state.latents = pipe.prepare_latents(p.num_images, num_channels_latents, p.height, p.width,
                                             embeds.dtype, self.device, state.generator)
        h, w = p.height // pipe.vae_scale_factor // 2, p.width // pipe.vae_scale_factor // 2
        state.extra["img_shape"] = (1, h, w)

        # The copy is request-local: diffusers keeps `_step_index` on the scheduler object.
        # Copying before set_timesteps (rather than after) also leaves pipe.scheduler untouched.
        scheduler = copy.deepcopy(pipe.scheduler)
        n = p.num_inference_steps
        sigmas = np.linspace(1.0, 1 / n, n)
        mu = calculate_shift(
            state.latents.shape[1],
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        state.timesteps, state.num_steps = retrieve_timesteps(scheduler, n, self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        state.scheduler = scheduler
        state.step_index = 0

    @torch.inference_mode()
    def denoise_step(self, input_batch: InputBatch, *, states: list[StepRequestState]) -> torch.Tensor:
        """The noise prediction for every row of the batch at each row's own timestep (CFG applied)."""
        assert [s.request_id for s in states] == input_batch.request_ids, "states must match the input batch"
        do_cfg = {s.params.do_true_cfg for s in states}
        assert len(do_cfg) == 1, "requests with and without true CFG never share a batch (see the keys)"
        latents = input_batch.latents
        # As the pipeline: the timestep in the latents' dtype, then / 1000.
        timestep = input_batch.timesteps.to(latents.dtype) / 1000
        img_shapes = [[s.extra["img_shape"]] for s in states for _ in range(s.num_rows)]
        guidance = self._guidance(states)
        text = self._text_inputs(input_batch)
        if not do_cfg.pop():
            return self._transformer(latents, timestep, *text["cond"], img_shapes, guidance, "cond")

        scales = {float(s.params.true_cfg_scale) for s in states}
        assert len(scales) == 1, "one true_cfg_scale per batch (it is part of the keys)"
        if self.cfg_batching:
            both = self._transformer(
                torch.cat([latents, latents]), torch.cat([timestep, timestep]), *text["cond_uncond"],
                img_shapes + img_shapes, None if guidance is None else torch.cat([guidance, guidance]), "cond",
            )
            cond, uncond = both.chunk(2)
        else:
            cond = self._transformer(latents, timestep, *text["cond"], img_shapes, guidance, "cond")
            uncond = self._transformer(latents, timestep, *text["uncond"], img_shapes, guidance, "uncond")
        return _true_cfg(cond, uncond, scales.pop())

    @torch.inference_mode()
    def step_scheduler(self, state: StepRequestState, noise_pred: torch.Tensor) -> None:
        """The only place a request's latents change and its step index advances."""
        t = state.timesteps[state.step_index]
        state.latents = state.scheduler.step(noise_pred, t, state.latents, return_dict=False)[0]
        state.step_index += 1

    @torch.inference_mode()
    def post_decode(self, states: list[StepRequestState]) -> list[np.ndarray]:
        return [to_uint8(images) for images in self.decode_float(states)]

    @torch.inference_mode()
    def decode_float(self, states: list[StepRequestState]) -> list[np.ndarray]:
        """`post_decode` before the uint8 rounding: float32 [N, H, W, 3] in [0, 1] per state.

        One `vae.decode` call per image size for all the given states.
        """
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, state in enumerate(states):
            by_size.setdefault((state.params.height, state.params.width), []).append(i)
        out: list[Optional[np.ndarray]] = [None] * len(states)
        for (height, width), indices in by_size.items():
            latents = torch.cat([states[i].latents for i in indices])
            latents = self.pipe._unpack_latents(latents, height, width, self.pipe.vae_scale_factor)
            images = self.pipe.image_processor.postprocess(self._vae_decode(latents), output_type="np")
            start = 0
            for i in indices:
                rows = states[i].num_rows
                out[i] = images[start:start + rows]
                start += rows
        return out

    @torch.inference_mode()
    def preview(self, state: StepRequestState) -> np.ndarray:
        """A fixed linear map of the current latents to RGB, upsampled (nearest) to the image size.

        Reads the state only, so previews never change the final image.
        """
        p = state.params
        latents = self.pipe._unpack_latents(state.latents, p.height, p.width, self.pipe.vae_scale_factor)
        weights, bias = self._preview_projection()
        rgb = torch.einsum("nchw,cr->nrhw", latents[:, :, 0].float(), weights) + bias.view(1, 3, 1, 1)
        rgb = F.interpolate(rgb, size=(p.height, p.width), mode="nearest")
        rgb = ((rgb + 1) / 2).clamp(0, 1).mul(255).round().to(torch.uint8)
        return rgb.permute(0, 2, 3, 1).cpu().numpy()

    # -- helpers shared by every path ----------------------------------------
    def _transformer(self, latents, timestep, embeds, mask, img_shapes, guidance, cache_name: str) -> torch.Tensor:
        with self.pipe.transformer.cache_context(cache_name):
            return self.pipe.transformer(
                hidden_states=latents,
                timestep=timestep,
                guidance=guidance,
                encoder_hidden_states_mask=mask,
                encoder_hidden_states=embeds,
                img_shapes=img_shapes,
                attention_kwargs={},
                return_dict=False,
            )[0]

    def _guidance(self, states: list[StepRequestState]) -> Optional[torch.Tensor]:
        """Per-row guidance for guidance-distilled models (float32, as the pipeline builds it), else None."""
        if not self.pipe.transformer.config.guidance_embeds:
            return None
        values = [float(s.params.guidance_scale) for s in states for _ in range(s.num_rows)]
        return torch.tensor(values, device=self.device, dtype=torch.float32)

    def _text_inputs(self, input_batch: InputBatch) -> dict:
        """Batched (embeds, mask) pairs, padded once and cached while the batch membership holds."""
        text = input_batch.cache.get("text")
        if text is None:
            cond = [(s.extra["prompt_embeds"], s.extra["prompt_embeds_mask"]) for s in input_batch.states]
            text = {"cond": _pad_text(cond)}
            if input_batch.states[0].params.do_true_cfg:
                uncond = [(s.extra["negative_prompt_embeds"], s.extra["negative_prompt_embeds_mask"])
                          for s in input_batch.states]
                text["uncond"] = _pad_text(uncond)
                text["cond_uncond"] = _pad_text(cond + uncond)
            input_batch.cache["text"] = text
        return text

    def _vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Unpacked latents [N, C, 1, h, w] in the transformer's space -> images [N, 3, H, W] in [-1, 1].

        The de-normalisation is the pipeline's, operation for operation.
        """
        vae = self.pipe.vae
        latents = latents.to(vae.dtype)
        z_dim = vae.config.z_dim
        latents_mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(
            latents.device, latents.dtype
        )
        latents = latents / latents_std + latents_mean
        return vae.decode(latents, return_dict=False)[0][:, :, 0]

    def _preview_projection(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent -> RGB weights [C, 3] and bias [3], measured once from this model's own VAE.

        The VAE decodes a zero latent (the bias) and one unit latent per channel
        (bias + that channel's weights), all spatially constant: the decoder's
        linear response around the latent mean. Nothing model-specific is baked in,
        so the same recipe serves any VAE.
        """
        if self._preview_weights is None:
            z_dim = self.pipe.vae.config.z_dim
            basis = torch.cat([torch.zeros(1, z_dim), torch.eye(z_dim)]).to(self.device)
            latents = basis.view(z_dim + 1, z_dim, 1, 1, 1).expand(z_dim + 1, z_dim, 1, 4, 4).contiguous()
            rgb = self._vae_decode(latents).float().mean(dim=(2, 3))  # [z_dim + 1, 3]
            self._preview_weights = (rgb[1:] - rgb[0], rgb[0])
        return self._preview_weights


def _true_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """diffusers' true CFG: the guided prediction rescaled to the conditional one's norm, per token."""
    comb = uncond + scale * (cond - uncond)
    cond_norm = torch.norm(cond, dim=-1, keepdim=True)
    noise_norm = torch.norm(comb, dim=-1, keepdim=True)
    return comb * (cond_norm / noise_norm)


def _pad_text(parts: list[tuple[torch.Tensor, Optional[torch.Tensor]]]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Stack per-request prompt embeddings, right-padding shorter ones with zeros and a 0 mask.

    Without padding the mask stays None, as `encode_prompt` returns it, so a solo
    request runs exactly the pipeline's forward.
    """
    lengths = [embeds.shape[1] for embeds, _ in parts]
    longest = max(lengths)
    if all(n == longest for n in lengths) and all(mask is None for _, mask in parts):
        return (parts[0][0] if len(parts) == 1 else torch.cat([e for e, _ in parts])), None
    embeds = torch.cat([F.pad(e, (0, 0, 0, longest - e.shape[1])) for e, _ in parts])
    masks = []
    for e, mask in parts:
        if mask is None:
            mask = torch.ones(e.shape[:2], dtype=torch.long, device=e.device)
        masks.append(F.pad(mask, (0, longest - mask.shape[1])))
    return embeds, torch.cat(masks)
