"""FLUX.1 Kontext behind the engine's contracts: `FluxKontextPipeline.__call__` cut into its phases.

Kontext is Flux (text, schedule, guidance, decode: flux/adapter.py) conditioned on an image:

* the `image` is resized as the pipeline resizes it: to the nearest of Kontext's preferred resolutions by
  aspect ratio (`auto_resize`, diffusers' `_auto_resize`, default on), or kept at its own size, then rounded
  down to the size multiple (the VAE's factor times the 2x2 packing: 16 pixels for FLUX.1, 8 for the tiny model);
  an image with a side under the size multiple is refused, with or without `auto_resize`;
* `prepare_latents` VAE-encodes it (the distribution's mode: no draw from the generator) and packs it into
  condition tokens, whose ids are the latents' with their first index 1; the request keeps them in its own
  state, one row per image of the request;
* each forward appends every row's condition tokens to its latent tokens (and their ids to the latents'),
  and cuts the prediction back to the latent tokens;
* the output is height x width: diffusers scales its height and width to `max_area` pixels, so the engine
  calls it with `max_area = height x width`.

Rows of one forward share their ids, so the keys hold the output size and the condition's size (the resized
image's); requests with different images of that size, and different prompts, share steps. With
`mixed_size_batching` the keys leave both out: a forward of rows of different sizes packs each row's latent
tokens followed by its own condition tokens, with its own ids (flux/mixed_sizes.py), and cuts each row back to
its latent tokens. The step cache is not offered here.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Optional

import torch

from engine_lib.interface import InputSpec
from engine_lib.pipelines.flux.adapter import FluxAdapter, FluxState
from engine_lib.pipelines.flux.mixed_sizes import FluxPacking, packed_forward
from engine_lib.pipelines.packing import condition_rows, conditioned_forward
from engine_lib.pipelines.step_cache import CACHE_INPUTS
from engine_lib.request import InvalidInputError, SamplingParams

IMAGE = InputSpec("image", "BYTES", "the image to edit (PNG, JPEG or WebP; required), resized as auto_resize says",
                  content="image", batch="row", pipe_arg="image")
AUTO_RESIZE = InputSpec("auto_resize", "INT32", "1: the image is resized to the nearest of Kontext's preferred "
                        "resolutions (about 1 megapixel) by aspect ratio, as diffusers does; 0: kept at its own size; "
                        "either rounded down to the size multiple (16 pixels for FLUX.1)", default=1, low=0, high=1, batch="adapter",
                        pipe_arg="_auto_resize")
_CACHE_NAMES = {spec.name for spec in CACHE_INPUTS}


@dataclass
class FluxKontextState(FluxState):
    """A Kontext request between steps: `img_ids` are its latent tokens' ids followed by its condition's."""

    image_latents: Optional[torch.Tensor] = None  # [num_images, condition tokens, C * 4]: the packed image


class FluxKontextAdapter(FluxAdapter):
    """`FluxKontextPipeline` (image editing) with request batching, step execution and previews."""

    name = "flux_kontext"
    pipeline_class = "FluxKontextPipeline"
    inputs = tuple(spec for spec in FluxAdapter.inputs if spec.name not in _CACHE_NAMES) + (IMAGE, AUTO_RESIZE)
    state_class = FluxKontextState
    step_key_skips = ("height", "width", "condition")  # with mixed_size_batching: packed, each row its own ids
    # its image's tokens join the sequence (cut off after the forward): no sequence parallel; no cfg_parallel either
    # (Flux's runs, its ranks with the condition tokens are untested)
    capabilities = FluxAdapter.capabilities.without("sequence_parallel", "cfg_parallel", "first_block",
                                                    "taylorseer").with_features("image_input")

    @classmethod
    def example_inputs(cls) -> dict:
        """A 32x32 gradient PNG kept at its size: resized to a megapixel it would cost a tiny model a minute."""
        from PIL import Image

        buffer = io.BytesIO()
        Image.linear_gradient("L").resize((32, 32)).convert("RGB").save(buffer, format="PNG")
        return {"image": buffer.getvalue(), "auto_resize": 0}

    def condition_size(self, params: SamplingParams) -> Optional[tuple[int, int]]:
        """(height, width) the image is encoded at, as `__call__` computes it (None without an image)."""
        from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

        if params.image is None:
            return None
        height, width = self.pipe.image_processor.get_default_height_width(params.image.image)
        if params.auto_resize:
            _, width, height = min((abs(width / height - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
        multiple = self.size_multiple
        return height // multiple * multiple, width // multiple * multiple

    def check_inputs(self, params: SamplingParams) -> None:
        super().check_inputs(params)
        if params.image is None:
            raise InvalidInputError("image", "is required: Kontext edits an image (send one PNG, JPEG or WebP file)")
        width, height = params.image.size
        # auto_resize reads the aspect ratio of the size rounded down to the VAE's factor: a side under it
        # divides by zero in diffusers (and without auto_resize the condition would have no tokens)
        if min(width, height) < self.size_multiple:
            raise InvalidInputError("image", f"{width}x{height} is too small: at least {self.size_multiple} pixels "
                                    "a side")

    def key_fields(self, params: SamplingParams) -> tuple:
        """Flux's, and the condition's size: every row of a forward has as many condition tokens."""
        return super().key_fields(params) + (("condition", self.condition_size(params)),)

    def request_cost(self, params: SamplingParams) -> int:
        """Flux's image tokens plus the condition's, per image and CFG pass."""
        height, width = self.condition_size(params) or (0, 0)
        condition = (height // self.size_multiple) * (width // self.size_multiple)
        return super().request_cost(params) + condition * params.num_images * (2 if self.do_cfg(params) else 1)

    def pipe_kwargs(self, params: SamplingParams) -> dict:
        """`FluxKontextPipeline`'s arguments: the decoded image, and `max_area` that keeps height x width."""
        return {**super().pipe_kwargs(params), "image": params.image.image, "max_area": params.height * params.width}

    # -- pipeline-specific phases ------------------------------------------------
    def _initial_latents(self, state: FluxKontextState) -> torch.Tensor:
        p, processor = state.params, self.pipe.image_processor
        embeds = state.text["cond"]["embeds"]
        # encode_prompt's text ids, made here so cached embeddings need none: zeros [L, 3] in the encoder's dtype
        state.txt_ids = torch.zeros(embeds.shape[1], 3, device=self.device, dtype=self.pipe.text_encoder.dtype)
        height, width = self.condition_size(p)
        image = processor.preprocess(processor.resize(p.image.image, height, width), height, width)
        latents, state.image_latents, latent_ids, image_ids = self.pipe.prepare_latents(
            image, p.num_images, self.pipe.transformer.config.in_channels // 4, p.height, p.width, embeds.dtype,
            self.device, state.generator)
        state.img_ids = torch.cat([latent_ids, image_ids])  # the condition's ids: index 0 is 1
        return latents

    def _row_inputs(self, states: list[FluxKontextState]) -> dict:
        rows = {"guidance": self._guidance_rows(states)}
        if len({(s.latents.shape[1], s.image_latents.shape[1]) for s in states}) == 1:
            return {**rows, "condition": torch.cat([s.image_latents for s in states])}
        # rows of different output or condition sizes: each row's latent and condition tokens packed, its own ids
        return {**rows, **condition_rows(states), "packing": FluxPacking(
            self.pipe.transformer.pos_embed, states[0].txt_ids, [s.img_ids for s in states for _ in range(s.num_rows)],
            self.device)}

    # -- the forwards FlowMatchAdapter._forward chooses from ---------------------------
    def _plain_forward(self, latents, timestep, text, rows, states) -> torch.Tensor:
        """diffusers' forward over the latent tokens followed by the condition's, cut back to the latent tokens."""
        return self.pipe.transformer(
            hidden_states=torch.cat([latents, rows["condition"]], dim=1),
            timestep=timestep,
            guidance=rows["guidance"],
            pooled_projections=text["pooled"],
            encoder_hidden_states=text["embeds"],
            txt_ids=states[0].txt_ids,
            img_ids=states[0].img_ids,
            return_dict=False,
        )[0][:, :latents.shape[1]]

    def _packed_forward(self, latents, timestep, text, rows) -> torch.Tensor:
        """Rows of different sizes: each row's latent and condition tokens, packed."""
        return conditioned_forward(lambda padded: packed_forward(
            self.pipe.transformer, padded, timestep, rows["guidance"], text["pooled"], text["embeds"],
            rows["packing"]), latents, rows)


ADAPTER = FluxKontextAdapter
