"""What every flow-matching text-to-image adapter shares (Qwen-Image, Flux, SD3).

Their diffusers pipelines have the same `__call__` skeleton: encode the prompt(s),
draw latents, build timesteps on `FlowMatchEulerDiscreteScheduler`, loop
transformer forward (+ CFG) and `scheduler.step`, decode. `FlowMatchAdapter`
holds that skeleton once, cut into the engine's step methods:

* `forward` (request batch) = `prepare_encode` per request + the batched step loop
  + `post_decode`, so request mode and step mode share every line;
* `prepare_encode`: the adapter's `_encode`, a per-request generator, the adapter's
  `_initial_latents`, and `retrieve_timesteps` on a request-local scheduler copy;
* `denoise_step`: one transformer forward over all rows (each with its own
  timestep), CFG as one forward of 2B rows or two of B rows (`cfg_batching`);
* `step_scheduler`, `post_decode` (one `vae.decode` per image size), `preview`
  (a latent->RGB projection measured from the model's own VAE).

A subclass supplies only what is pipeline-specific: how it encodes text, draws
latents, sets its schedule, calls its transformer, and unpacks/decodes latents.
"""

from __future__ import annotations

import contextlib
import copy
from typing import ClassVar, Optional

import numpy as np
import torch
import torch.nn.functional as F

from engine_lib.pipelines.base import DiffusionRequestBatch, InputBatch, PipelineAdapter, StepRequestState
from engine_lib.request import ConfigError, InvalidInputError, SamplingParams

# The text tensors of one side (cond or uncond) of one request: "embeds" [N, L, D]
# plus whatever else the transformer takes per row ("mask" [N, L], "pooled" [N, P]).
TextParts = dict


def to_uint8(images: np.ndarray) -> np.ndarray:
    """Float images in [0, 1] to uint8, rounding exactly as diffusers' `numpy_to_pil`."""
    return (images * 255).round().astype("uint8")


class FlowMatchAdapter(PipelineAdapter):
    """The shared skeleton; see the module docstring for the split.

    Options: `cfg_batching` (default True): CFG cond and uncond as one forward of
    2B rows (False: two forwards of B rows); `max_sequence_length`: the text
    length used when a request leaves it unset (default: the pipeline's own).
    """

    pipeline_class: ClassVar[str]  # the diffusers class, e.g. "FluxPipeline"
    default_max_sequence_length: ClassVar[int]  # the pipeline's `__call__` default
    max_max_sequence_length: ClassVar[int]  # what the pipeline's `check_inputs` allows
    min_steps: ClassVar[int] = 1
    # Order of the two halves of a batched CFG forward: diffusers' SD3 puts the
    # negative first, Qwen-Image/Flux (two forwards there) are kept cond-first.
    cfg_order: ClassVar[tuple[str, str]] = ("cond", "uncond")
    # Padded text batches need a transformer that takes a text mask (Qwen-Image);
    # without one, equal text lengths are guaranteed by the keys instead.
    pads_text: ClassVar[bool] = False

    def __init__(self, pipe, device: torch.device, dtype: torch.dtype, options: Optional[dict] = None):
        super().__init__(pipe, device, dtype, options)
        self.cfg_batching = bool(self.options.get("cfg_batching", True))
        self.max_sequence_length = int(self.options.get("max_sequence_length") or self.default_max_sequence_length)
        if not 1 <= self.max_sequence_length <= self.max_max_sequence_length:
            raise ConfigError(f"parameter 'max_sequence_length': {self.max_sequence_length} must be in "
                              f"[1, {self.max_max_sequence_length}] for {self.name}")
        self._preview_weights: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    # -- loading and limits --------------------------------------------------
    @classmethod
    def load(cls, model_path: str, device: torch.device, dtype: torch.dtype,
             options: Optional[dict] = None) -> "FlowMatchAdapter":
        import diffusers

        pipeline_cls = getattr(diffusers, cls.pipeline_class)
        pipe = pipeline_cls.from_pretrained(str(model_path), dtype=dtype)  # diffusers 0.42: torch_dtype is deprecated
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        return cls(pipe, torch.device(device), dtype, options)

    def validate(self, params: SamplingParams) -> None:
        super().validate(params)
        if params.num_inference_steps < self.min_steps:
            raise InvalidInputError("num_inference_steps",
                                    f"{params.num_inference_steps} must be >= {self.min_steps}")
        if params.num_images < 1:
            raise InvalidInputError("num_images", f"{params.num_images} must be >= 1")
        msl = params.max_sequence_length
        if msl is not None and not 1 <= msl <= self.max_max_sequence_length:
            raise InvalidInputError("max_sequence_length", f"{msl} must be in [1, {self.max_max_sequence_length}]")

    def text_length(self, params: SamplingParams) -> int:
        """The `max_sequence_length` this request is encoded with."""
        return int(params.max_sequence_length or self.max_sequence_length)

    # -- what a subclass supplies ------------------------------------------------
    def do_cfg(self, params: SamplingParams) -> bool:
        """Whether this request runs a second (unconditional) pass."""
        return params.do_true_cfg

    def cfg_scale(self, params: SamplingParams) -> float:
        return float(params.true_cfg_scale)

    def _encode(self, state: StepRequestState) -> dict[str, TextParts]:
        """{"cond": parts, and "uncond": parts when do_cfg}, each for `num_images` rows (may fill `state.extra`)."""
        raise NotImplementedError

    def _initial_latents(self, state: StepRequestState) -> torch.Tensor:
        """The pipeline's `prepare_latents` with `state.generator` (may also fill `state.extra`)."""
        raise NotImplementedError

    def _timestep_kwargs(self, state: StepRequestState) -> dict:
        """`retrieve_timesteps` arguments (sigmas, mu) as the pipeline computes them."""
        raise NotImplementedError

    def _row_inputs(self, states: list[StepRequestState]) -> dict:
        """Per-row transformer inputs other than latents, timestep and text (tensors or lists, or None)."""
        return {}

    def _transformer(self, latents: torch.Tensor, timestep: torch.Tensor, text: TextParts, rows: dict,
                     states: list[StepRequestState]) -> torch.Tensor:
        """One transformer call, exactly as the pipeline's denoising loop makes it."""
        raise NotImplementedError

    def _model_timestep(self, timesteps: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The scheduler's per-row timesteps as the transformer takes them (default: Flux/Qwen's `/ 1000`)."""
        return timesteps.to(latents.dtype) / 1000

    def _combine_cfg(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """diffusers' guidance formula (Flux's true CFG and SD3's CFG are this one)."""
        return uncond + scale * (cond - uncond)

    def _unpack(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Transformer-space latents -> [N, C, h, w] as the VAE sees them (before de-normalising)."""
        return latents

    def _vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        """[N, C, h, w] transformer-space latents -> [N, 3, H, W] in [-1, 1] (AutoencoderKL's de-normalisation)."""
        config = self.pipe.vae.config
        latents = (latents / config.scaling_factor) + config.shift_factor
        return self.pipe.vae.decode(latents, return_dict=False)[0]

    @property
    def latent_channels(self) -> int:
        return int(self.pipe.vae.config.latent_channels)

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
        from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps

        p = state.params
        state.extra["text"] = self._encode(state)
        state.generator = torch.Generator(device=self.device).manual_seed(int(p.seed))
        state.latents = self._initial_latents(state)
        # The copy is request-local: diffusers keeps `_step_index` on the scheduler object.
        # Copying before set_timesteps (rather than after) also leaves pipe.scheduler untouched.
        scheduler = copy.deepcopy(self.pipe.scheduler)
        state.timesteps, state.num_steps = retrieve_timesteps(scheduler, p.num_inference_steps, self.device,
                                                              **self._timestep_kwargs(state))
        scheduler.set_begin_index(0)  # the step loop starts at the first timestep
        state.scheduler = scheduler
        state.step_index = 0

    @torch.inference_mode()
    def denoise_step(self, input_batch: InputBatch, *, states: list[StepRequestState]) -> torch.Tensor:
        """The noise prediction for every row of the batch at each row's own timestep (CFG applied)."""
        assert [s.request_id for s in states] == input_batch.request_ids, "states must match the input batch"
        do_cfg = {self.do_cfg(s.params) for s in states}
        assert len(do_cfg) == 1, "requests with and without CFG never share a batch (see the keys)"
        latents = input_batch.latents
        timestep = self._model_timestep(input_batch.timesteps, latents)
        rows = self._row_inputs(states)
        text = self._text_inputs(input_batch)
        if not do_cfg.pop():
            with self._cache_context("cond"):
                return self._transformer(latents, timestep, text["cond"], rows, states)

        scales = {self.cfg_scale(s.params) for s in states}
        assert len(scales) == 1, "one CFG scale per batch (it is part of the keys)"
        if self.cfg_batching:
            first, second = self.cfg_order
            with self._cache_context(first):
                both = self._transformer(torch.cat([latents, latents]), torch.cat([timestep, timestep]),
                                         text["cfg"], _repeat_rows(rows), states)
            pred = dict(zip(self.cfg_order, both.chunk(2)))
        else:
            pred = {}
            for side in ("cond", "uncond"):
                with self._cache_context(side):
                    pred[side] = self._transformer(latents, timestep, text[side], rows, states)
        return self._combine_cfg(pred["cond"], pred["uncond"], scales.pop())

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
            latents = self._unpack(torch.cat([states[i].latents for i in indices]), height, width)
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
        latents = self._unpack(state.latents, p.height, p.width)
        weights, bias = self._preview_projection()
        rgb = torch.einsum("nchw,cr->nrhw", latents.float(), weights) + bias.view(1, 3, 1, 1)
        rgb = F.interpolate(rgb, size=(p.height, p.width), mode="nearest")
        rgb = ((rgb + 1) / 2).clamp(0, 1).mul(255).round().to(torch.uint8)
        return rgb.permute(0, 2, 3, 1).cpu().numpy()

    # -- helpers shared by every path ----------------------------------------
    def _cache_context(self, name: str):
        """The transformer's cache context (as the pipelines enter it), where it has one (SD3's has none)."""
        cache_context = getattr(self.pipe.transformer, "cache_context", None)
        return cache_context(name) if cache_context is not None else contextlib.nullcontext()

    def _guidance_rows(self, states: list[StepRequestState], default: Optional[float]) -> Optional[torch.Tensor]:
        """Per-row embedded guidance (float32, as the pipelines build it) for guidance-distilled models, else None."""
        if not self.pipe.transformer.config.guidance_embeds:
            return None
        values = [float(default if s.params.guidance_scale is None else s.params.guidance_scale)
                  for s in states for _ in range(s.num_rows)]
        return torch.tensor(values, device=self.device, dtype=torch.float32)

    def _text_inputs(self, input_batch: InputBatch) -> dict[str, TextParts]:
        """Batched text per side ("cond", "uncond", and "cfg" = both in `cfg_order`), cached while
        the batch membership holds."""
        text = input_batch.cache.get("text")
        if text is None:
            sides = input_batch.states[0].extra["text"].keys()
            parts = {side: [s.extra["text"][side] for s in input_batch.states] for side in sides}
            text = {side: batch_text(parts[side], self.pads_text) for side in sides}
            if "uncond" in parts:
                first, second = self.cfg_order
                text["cfg"] = batch_text(parts[first] + parts[second], self.pads_text)
            input_batch.cache["text"] = text
        return text

    def _preview_projection(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent -> RGB weights [C, 3] and bias [3], measured once from this model's own VAE.

        The VAE decodes a zero latent (the bias) and one unit latent per channel
        (bias + that channel's weights), all spatially constant: the decoder's
        linear response around the latent mean. Nothing model-specific is baked in,
        so the same recipe serves any VAE.
        """
        if self._preview_weights is None:
            c = self.latent_channels
            basis = torch.cat([torch.zeros(1, c), torch.eye(c)]).to(self.device, self.pipe.vae.dtype)
            latents = basis.view(c + 1, c, 1, 1).expand(c + 1, c, 4, 4).contiguous()
            rgb = self._vae_decode(latents).float().mean(dim=(2, 3))  # [c + 1, 3]
            self._preview_weights = (rgb[1:] - rgb[0], rgb[0])
        return self._preview_weights


def _repeat_rows(rows: dict) -> dict:
    """Per-row inputs for a batched CFG forward: every row twice, in the same halves as the latents."""
    doubled = {}
    for name, value in rows.items():
        if value is None:
            doubled[name] = None
        elif isinstance(value, torch.Tensor):
            doubled[name] = torch.cat([value, value])
        else:
            doubled[name] = list(value) + list(value)
    return doubled


def batch_text(parts: list[TextParts], pad: bool) -> TextParts:
    """Stack per-request text tensors along rows.

    `embeds` of different lengths are right-padded with zeros and a 0 `mask` when
    `pad` (the transformer takes a mask), otherwise they must be equal (the keys
    guarantee it). Without padding the mask stays None, as `encode_prompt`
    returns it, so a solo request runs exactly the pipeline's forward.
    """
    embeds, mask = _pad_text([(p["embeds"], p.get("mask")) for p in parts], pad)
    out = {"embeds": embeds, "mask": mask}
    for name in parts[0]:
        if name not in out:
            out[name] = parts[0][name] if len(parts) == 1 else torch.cat([p[name] for p in parts])
    return out


def _pad_text(parts: list[tuple[torch.Tensor, Optional[torch.Tensor]]],
              pad: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    lengths = [embeds.shape[1] for embeds, _ in parts]
    longest = max(lengths)
    if all(n == longest for n in lengths) and all(mask is None for _, mask in parts):
        return (parts[0][0] if len(parts) == 1 else torch.cat([e for e, _ in parts])), None
    assert pad, f"text lengths {lengths} differ in one batch: max_sequence_length must be part of the keys"
    embeds = torch.cat([F.pad(e, (0, 0, 0, longest - e.shape[1])) for e, _ in parts])
    masks = []
    for e, mask in parts:
        if mask is None:
            mask = torch.ones(e.shape[:2], dtype=torch.long, device=e.device)
        masks.append(F.pad(mask, (0, longest - mask.shape[1])))
    return embeds, torch.cat(masks)
