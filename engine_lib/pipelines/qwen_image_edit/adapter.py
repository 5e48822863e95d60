"""Qwen-Image-Edit and Qwen-Image-Edit-Plus behind the engine's contracts: `QwenImageEditPipeline.__call__` and
`QwenImageEditPlusPipeline.__call__` cut into Qwen-Image's phases (qwen_image/adapter.py), with what editing adds:

* the input image(s) (`image`: Edit one, Edit-Plus one to `MAX_IMAGES`), resized as the pipelines do
  (`calculate_dimensions` to the area of `VAE_IMAGE_SIZE` for the VAE; Edit-Plus also to
  `CONDITION_IMAGE_SIZE` for the text encoder, Edit gives it the VAE's resized image);
* text: `encode_prompt` with the image(s): the edit template and its drop index, the processor's vision
  tokens; the prompt-embedding cache keys on the images' digests too;
* latents: `prepare_latents` VAE-encodes each image (the distribution's mode: the generator draws only
  the noise), packs it 2x2 and keeps it in the request's state; every forward takes
  `[latents, condition latents]` as its image tokens, `img_shapes` lists the output's shape and each
  condition's, and the prediction is cut back to the output's tokens;
* batching: the condition shapes (from the images' aspect ratios) are in the keys, so requests with
  different images and prompts but one condition shape share a step batch; with `mixed_size_batching`
  the keys leave the output size and the condition shapes out, and a forward of rows of different
  sizes packs each row's output tokens followed by its own condition tokens, each row with its own RoPE
  of its shapes (qwen_image/mixed_sizes.py), cut back to each row's output tokens.

The first-block cache is not offered here.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Optional

import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE,
                                                                        calculate_dimensions)
from PIL import Image

from engine_lib import interface
from engine_lib.config import ConfigError
from engine_lib.interface import replace_spec
from engine_lib.pipelines.packing import condition_rows, conditioned_forward
from engine_lib.pipelines.qwen_image.adapter import QwenImageAdapter, QwenImageState
from engine_lib.pipelines.qwen_image.mixed_sizes import QwenPacking, packed_forward
from engine_lib.request import InvalidInputError, SamplingParams

# diffusers' VAE_IMAGE_SIZE (1024 x 1024: Edit's __call__ writes it out) and CONDITION_IMAGE_SIZE (384 x 384,
# Edit-Plus's text encoder), and `calculate_dimensions` (that area at an image's aspect ratio, multiples of 32).
MAX_IMAGES = 4  # Edit-Plus: input images per request (each adds its tokens to every forward)
MAX_VISION_RATIO = 200  # Qwen2-VL's image processor refuses an image whose long side is more times its short one
_STEP_CACHE = ("cache", "cache_threshold")

# Required by check_inputs (declared optional: Triton's own refusal of a missing input would not name it).
IMAGE = interface.InputSpec("image", "BYTES", "the image to edit (PNG, JPEG or WebP; the output keeps its aspect "
                            "ratio only if height and width do)", content="image", batch="row", pipe_arg="image")


@dataclass
class QwenImageEditState(QwenImageState):
    """A request between steps; its input images' packed VAE latents [N, condition tokens, C] too."""

    image_latents: Optional[torch.Tensor] = None


class QwenImageEditAdapter(QwenImageAdapter):
    """`QwenImageEditPipeline`: one input image, with request batching, step execution and previews."""

    name = "qwen_image_edit"
    pipeline_class = "QwenImageEditPipeline"
    inputs = tuple(spec for spec in QwenImageAdapter.inputs if spec.name not in _STEP_CACHE) + (IMAGE,)
    state_class = QwenImageEditState
    step_key_skips = ("height", "width", "condition")  # with mixed_size_batching: packed, each row its own RoPE
    # its image's tokens join the sequence (cut off after the forward): no sequence parallel
    capabilities = (QwenImageAdapter.capabilities.without("sequence_parallel", "first_block",
                                                          "taylorseer").with_features("image_input")
                    .refuse("cfg_parallel", "lora", "not checked on the ranks with the image's tokens"))
    cost_reference = {**QwenImageAdapter.cost_reference, "image": None}

    def __init__(self, pipe, device, dtype, config=None):
        super().__init__(pipe, device, dtype, config)
        if self.mixed_size_batching and pipe.transformer.zero_cond_t:
            raise ConfigError("parameter 'mixed_size_batching'=true: the packed forward of mixed sizes does not run "
                              f"this checkpoint's zero_cond_t timestep of the condition tokens ({self.name})")

    @classmethod
    def example_inputs(cls) -> dict:
        """A 32x32 grey PNG (encoded at about 1024x1024 whatever its size, as the pipeline does)."""
        buffer = io.BytesIO()
        Image.new("RGB", (32, 32), (128, 128, 128)).save(buffer, format="PNG")
        return {"image": buffer.getvalue()}

    @classmethod
    def from_pretrained_kwargs(cls, model_path: str) -> dict:
        from engine_lib.pipelines.qwen_image_edit.processor import load

        processor = load(model_path)
        return {} if processor is None else {"processor": processor}

    # -- the input images ------------------------------------------------------------
    @staticmethod
    def images(params: SamplingParams) -> tuple:
        """The request's input images (InputImage), in order."""
        image = params.image
        return () if image is None else image if isinstance(image, tuple) else (image,)

    def vae_sizes(self, params: SamplingParams) -> list[tuple[int, int]]:
        """(width, height) each image is encoded at: Edit sizes its one image from its aspect ratio (diffusers
        takes the first of a list)."""
        width, height = self.images(params)[0].size if self.images(params) else (1, 1)
        return [calculate_dimensions(VAE_IMAGE_SIZE, width / height)]

    def vision_sizes(self, params: SamplingParams) -> list[tuple[int, int]]:
        """(width, height) each image is given to the text encoder's vision tower at: Edit gives it the VAE's."""
        return self.vae_sizes(params)

    def condition_shapes(self, params: SamplingParams) -> tuple:
        """The RoPE shape `(1, h, w)` of each image's condition tokens: what fixes their count and positions."""
        factor = self.pipe.vae_scale_factor * 2
        return tuple((1, height // factor, width // factor) for width, height in self.vae_sizes(params))

    def pipe_kwargs(self, params: SamplingParams) -> dict:
        return {**super().pipe_kwargs(params), "image": self._pipe_images(params)}

    def _pipe_images(self, params: SamplingParams):
        return self.images(params)[0].image

    def _prepared_images(self, params: SamplingParams) -> tuple:
        """(what the text encoder sees, what the VAE encodes) as `__call__` prepares them: the image resized to its
        VAE size, and that resized image preprocessed to [1, 3, 1, H, W]."""
        width, height = self.vae_sizes(params)[0]
        processor = self.pipe.image_processor
        resized = processor.resize(self.images(params)[0].image, height, width)
        return resized, processor.preprocess(resized, height, width).unsqueeze(2)

    def check_inputs(self, params: SamplingParams) -> None:
        super().check_inputs(params)
        if not self.images(params):
            raise InvalidInputError("image", "is required: the image to edit (PNG, JPEG or WebP)")
        # an image far from square is resized to a side of 0 (1x4096) or past what the vision tower takes (3x512)
        for image, vae, vision in zip(self.images(params), self.vae_sizes(params), self.vision_sizes(params)):
            if min(*vae, *vision) < 1 or max(vision) > MAX_VISION_RATIO * min(vision):
                raise InvalidInputError("image", f"{image.size[0]}x{image.size[1]} is too far from square: the pipeline "
                                        f"resizes it to {vae[0]}x{vae[1]} for the VAE and {vision[0]}x{vision[1]} for "
                                        f"the vision encoder, which need sides above 0 at most {MAX_VISION_RATIO}:1")

    # -- keys, cost, cache -----------------------------------------------------------
    def key_fields(self, params: SamplingParams) -> tuple:
        return super().key_fields(params) + (("condition", self.condition_shapes(params)),)

    def request_cost(self, params: SamplingParams) -> int:
        """Output and condition tokens x images x CFG passes."""
        output = (params.height // self.size_multiple) * (params.width // self.size_multiple)
        condition = sum(h * w for _, h, w in self.condition_shapes(params))
        return (output + condition) * params.num_images * (2 if self.do_cfg(params) else 1)

    def _text_key(self, params: SamplingParams) -> tuple:
        """The prompt is encoded with the images: a cached embedding serves only the same image files."""
        return super()._text_key(params) + (tuple(image.digest for image in self.images(params)),)

    # -- pipeline-specific phases ------------------------------------------------
    def _encode(self, state: QwenImageEditState) -> dict:
        params = state.params
        prompt_images, _ = self._prepared_images(params)
        sides = {"cond": params.prompt}
        if self.do_cfg(params):
            sides["uncond"] = params.negative_prompt
        text = {}
        for side, prompt in sides.items():
            embeds, mask = self.pipe.encode_prompt(prompt, image=prompt_images, device=self.device,
                                                   num_images_per_prompt=params.num_images,
                                                   max_sequence_length=self.text_length(params))
            text[side] = {"embeds": embeds, "mask": mask}
        return text

    def _initial_latents(self, state: QwenImageEditState) -> torch.Tensor:
        pipe, p = self.pipe, state.params
        _, vae_images = self._prepared_images(p)
        dtype = state.text["cond"]["embeds"].dtype
        latents, state.image_latents = pipe.prepare_latents(
            vae_images, p.num_images, pipe.transformer.config.in_channels // 4, p.height, p.width, dtype, self.device,
            state.generator)
        state.img_shape = (1, p.height // pipe.vae_scale_factor // 2, p.width // pipe.vae_scale_factor // 2)
        return latents

    def _row_inputs(self, states: list[QwenImageEditState]) -> dict:
        shapes = [[s.img_shape, *self.condition_shapes(s.params)] for s in states for _ in range(s.num_rows)]
        rows = {"img_shapes": shapes, "guidance": self._guidance_rows(states)}
        if len({tuple(row) for row in shapes}) == 1:
            return {**rows, "image_latents": torch.cat([s.image_latents for s in states])}
        # rows of different output or condition shapes: each row's tokens packed, with its own RoPE
        return {**rows, **condition_rows(states),
                "packing": QwenPacking(self.pipe.transformer.pos_embed, shapes, self.device)}

    # -- the forwards FlowMatchAdapter._forward chooses from ---------------------------
    def _plain_forward(self, latents, timestep, text, rows, states) -> torch.Tensor:
        """diffusers' forward on `[latents, condition latents]`, cut back to the output's tokens."""
        return self.pipe.transformer(
            hidden_states=torch.cat([latents, rows["image_latents"]], dim=1),
            timestep=timestep,
            guidance=rows["guidance"],
            encoder_hidden_states_mask=text["mask"],
            encoder_hidden_states=text["embeds"],
            img_shapes=rows["img_shapes"],
            return_dict=False,
        )[0][:, :latents.size(1)]

    def _packed_forward(self, latents, timestep, text, rows) -> torch.Tensor:
        """Rows of different output or condition sizes: each row's tokens, packed."""
        return conditioned_forward(lambda padded: packed_forward(
            self.pipe.transformer, padded, timestep, rows["guidance"], text["embeds"], text["mask"],
            rows["packing"]), latents, rows)


class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    """`QwenImageEditPlusPipeline`: one to four input images, each its own condition tokens and vision tokens.

    The images are the n elements of one `image` input ([n], at most MAX_IMAGES); each adds a "Picture i:" and
    its vision tokens to the prompt."""

    name = "qwen_image_edit_plus"
    pipeline_class = "QwenImageEditPlusPipeline"
    inputs = replace_spec(QwenImageEditAdapter.inputs, "image", max_count=MAX_IMAGES,
                          doc="the images to edit or combine, as the n elements of this one input (PNG, JPEG or WebP)")

    def vae_sizes(self, params: SamplingParams) -> list[tuple[int, int]]:
        return [calculate_dimensions(VAE_IMAGE_SIZE, width / height)
                for width, height in (image.size for image in self.images(params))] or [(1024, 1024)]

    def vision_sizes(self, params: SamplingParams) -> list[tuple[int, int]]:
        """Each image at the area of CONDITION_IMAGE_SIZE, at its aspect ratio."""
        return [calculate_dimensions(CONDITION_IMAGE_SIZE, width / height)
                for width, height in (image.size for image in self.images(params))]

    def _pipe_images(self, params: SamplingParams):
        return [image.image for image in self.images(params)]

    def _prepared_images(self, params: SamplingParams) -> tuple:
        """(the images resized to about CONDITION_IMAGE_SIZE for the text encoder, each image preprocessed at its
        VAE size [1, 3, 1, H, W]), as `__call__` prepares them."""
        processor, condition, vae = self.pipe.image_processor, [], []
        for image, (vae_width, vae_height), (width, height) in zip(self.images(params), self.vae_sizes(params),
                                                                   self.vision_sizes(params)):
            condition.append(processor.resize(image.image, height, width))
            vae.append(processor.preprocess(image.image, vae_height, vae_width).unsqueeze(2))
        return condition, vae


ADAPTER = QwenImageEditAdapter
