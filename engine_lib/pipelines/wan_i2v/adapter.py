"""Wan image to video: `WanImageToVideoPipeline.__call__` on the text-to-video adapter's steps.

A request's `image` (its first frame) is resized to height x width and VAE-encoded
(the distribution's mode) once, at admission, as the pipeline's `prepare_latents`
does; what the transformer sees then depends on the release:

* Wan2.1 and Wan2.2 A14B: the noise latents with a condition concatenated on the
  channels (4 mask channels, 1 on the first frame, and the image's latents followed
  by those of empty frames), 36 channels; Wan2.1 also attends to the image's CLIP
  tokens (`encode_image`, `image_dim` in the transformer's config);
* Wan2.2 TI2V-5B (`expand_timesteps`): the first latent frame is the image's
  latents, its tokens at timestep 0 in every step, and stays so to the decode.

The condition lives in the request's state (`condition`, `mask`, `image_embeds`),
so requests with different images share every forward; experts, guidance and
batching are the text-to-video adapter's (engine_lib/pipelines/wan/adapter.py).
"""

from __future__ import annotations

import io

import torch

from engine_lib.interface import InputSpec
from engine_lib.pipelines.wan.adapter import WAN_INPUTS, WanAdapter, WanState
from engine_lib.request import InvalidInputError, SamplingParams

IMAGE = InputSpec("image", "BYTES", "the first frame (PNG, JPEG or WebP; required), resized to height x width",
                  content="image", batch="row", pipe_arg="image")


class WanImageToVideoAdapter(WanAdapter):
    """`WanImageToVideoPipeline` (Wan2.1, Wan2.2 A14B, Wan2.2 TI2V-5B), with request batching and step execution."""

    name = "wan_i2v"
    pipeline_class = "WanImageToVideoPipeline"
    inputs = WAN_INPUTS + (IMAGE,)
    capabilities = WanAdapter.capabilities.with_features("image_input")

    @classmethod
    def example_inputs(cls) -> dict:
        """A 32x32 gradient PNG: the first frame a request needs."""
        from PIL import Image

        buffer = io.BytesIO()
        Image.linear_gradient("L").resize((32, 32)).convert("RGB").save(buffer, format="PNG")
        return {"image": buffer.getvalue()}

    def check_inputs(self, params: SamplingParams) -> None:
        super().check_inputs(params)
        if params.image is None:
            raise InvalidInputError("image", "is required: image to video starts from it (send one PNG, JPEG or "
                                             "WebP file)")

    def pipe_kwargs(self, params: SamplingParams) -> dict:
        return {**super().pipe_kwargs(params), "image": params.image.image}

    def _prepare_latents(self, state: WanState) -> None:
        """The image's CLIP tokens (Wan2.1), then the noise and the condition, as `__call__` makes them."""
        p, pipe = state.params, self.pipe
        if pipe.transformer.config.image_dim is not None:
            state.image_embeds = pipe.encode_image(p.image.image, self.device).to(pipe.transformer.dtype)
        image = pipe.video_processor.preprocess(p.image.image, height=p.height, width=p.width)
        out = pipe.prepare_latents(image.to(self.device, dtype=torch.float32), 1, pipe.vae.config.z_dim, p.height,
                                   p.width, p.num_frames, torch.float32, self.device, state.generator)
        state.latents, state.condition = out[:2]
        if pipe.config.expand_timesteps:
            state.mask = out[2]

    def _with_image(self, state: WanState) -> torch.Tensor:
        """expand_timesteps: the latents with the first frame the image's (`(1 - mask) * condition + mask * x`)."""
        return (1 - state.mask) * state.condition + state.mask * state.latents

    def _model_input(self, state: WanState) -> torch.Tensor:
        if self.pipe.config.expand_timesteps:
            return self._with_image(state).to(self.pipe.transformer.dtype)
        return torch.cat([state.latents, state.condition], dim=1).to(self.pipe.transformer.dtype)

    def _final_latents(self, state: WanState) -> torch.Tensor:
        return self._with_image(state) if self.pipe.config.expand_timesteps else state.latents


ADAPTER = WanImageToVideoAdapter
