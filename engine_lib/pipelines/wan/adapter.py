"""Wan text to video behind the engine's step contract: `WanPipeline.__call__` cut into its phases.

One adapter serves the three text-to-video releases, told apart by the checkpoint's
own config: Wan2.1 (one transformer), Wan2.2 A14B (two experts: `transformer` for
the high-noise steps, `transformer_2` for the low-noise ones, switched at
`boundary_ratio` x `num_train_timesteps`) and Wan2.2 TI2V-5B (`expand_timesteps`:
one timestep per latent token).

* `prepare_encode`: `encode_prompt` (UMT5; with CFG the negative prompt, "" when
  none), `prepare_latents` with the request's generator, the request's own copy of
  the scheduler (UniPC keeps a history of model outputs, so a shared one could not
  serve two requests) and its timesteps;
* `denoise_step`: each row takes the expert of its own timestep, as the pipeline's
  loop chooses it, and each expert runs one forward over its own rows ("cond"),
  then one over those of its rows that run CFG ("uncond", as the pipeline's second
  call); each request's guidance with its expert's scale (`guidance_scale`, or
  `guidance_scale_2` on the low-noise expert);
* `step_scheduler`: the request's scheduler step;
* `post_decode`: the VAE's de-normalisation, `vae.decode`, `postprocess_video`.

Requests at different steps, on different experts, with different prompts, seeds,
guidance and LoRAs share ticks; size, frame count and text length (the token
shapes) are in the keys. `WanImageToVideoPipeline` (engine_lib/pipelines/wan_i2v/)
adds its image condition to the same steps.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import numpy as np
import torch

from engine_lib import interface
from engine_lib.interface import FRAME_RATE, VIDEO, InputSpec, replace_spec
from engine_lib.lora import LORA_INPUTS, LoraLibrary, RowLora
from engine_lib.pipelines import step_cache
from engine_lib.pipelines.capabilities import make
from engine_lib.pipelines.base import DiffusersAdapter, InputBatch, Outputs, RequestState
from engine_lib.pipelines.vae import video_vae_stats
from engine_lib.request import InvalidInputError, SamplingParams

FRAME_RATE_FPS = interface.VIDEO_FRAME_RATES["wan"]  # the Wan releases' (diffusers' examples export at 16 fps)

WAN_INPUTS = (
    interface.PROMPT,
    interface.NEGATIVE_PROMPT,
    replace(interface.HEIGHT, doc="frame height in pixels"),
    replace(interface.WIDTH, doc="frame width in pixels"),
    replace(interface.NUM_FRAMES, default=17, doc="video frames: 4k + 1 (4: the VAE's temporal compression; the "
                                                  "releases are trained on 81)"),
    interface.NUM_INFERENCE_STEPS,
    interface.SEED,
    InputSpec("guidance_scale", "FP32", "classifier-free guidance scale: > 1 runs the negative_prompt (or \"\") as "
              "a second pass (Wan2.2 A14B: the high-noise expert's)", default=5.0, low=0,
              high=interface.GUIDANCE_HIGH, batch="row", pipe_arg="guidance_scale"),
    InputSpec("guidance_scale_2", "FP32", "Wan2.2 A14B: the low-noise expert's guidance scale (default: "
              "guidance_scale)", low=0, high=interface.GUIDANCE_HIGH, batch="row", pipe_arg="guidance_scale_2"),
    InputSpec("max_sequence_length", "INT32", "text tokens each prompt is padded to", default=512, low=1, high=512,
              pipe_arg="max_sequence_length"),
    InputSpec("preview_interval", "INT32", "0: final response only; k: a progress response every k steps (step "
              "counts, no frames)", default=0, low=0, high=interface.INT_RANGES["INT32"][1], batch="row"),
    interface.output_format("mp4"),
    interface.PRIORITY,
    *LORA_INPUTS,
    *step_cache.CACHE_INPUTS,
)


@dataclass
class WanState(RequestState):
    """One request between steps: its text, noise latents, scheduler copy and (image to video) its condition."""

    generator: Optional[torch.Generator] = None
    scheduler: Any = None
    timesteps: Optional[torch.Tensor] = None
    latents: Optional[torch.Tensor] = None  # [1, C, F, h, w] float32
    text: dict = field(default_factory=dict)  # "cond" (and "uncond" with CFG) -> {"embeds": [1, L, D]}
    image_embeds: Optional[torch.Tensor] = None  # Wan2.1 image to video: the CLIP image tokens [1, T, D]
    condition: Optional[torch.Tensor] = None  # image to video: mask and image latents (or the image's latents)
    mask: Optional[torch.Tensor] = None  # expand_timesteps image to video: 0 on the first latent frame, else 1
    step_cache: dict = field(default_factory=dict)  # "<cond|uncond><expert>" -> step_cache.BranchCache

    @property
    def num_rows(self) -> int:
        return 1

    def step_inputs(self) -> dict[str, torch.Tensor]:
        return {"latents": self.latents}


class WanAdapter(DiffusersAdapter):
    """`WanPipeline` (text to video: Wan2.1, Wan2.2 A14B, Wan2.2 TI2V-5B), with request batching and step execution."""

    name = "wan"
    pipeline_class = "WanPipeline"
    cost_reference = {"height": 480, "width": 832, "num_frames": 81, "guidance_scale": 5.0}
    inputs = WAN_INPUTS
    outputs = (VIDEO, FRAME_RATE)
    state_class = WanState
    # previews: progress responses (no frames)
    capabilities = make("request_batch", "step_execution", "previews", "lora", "first_block")
    batched_decode = False  # each video decodes alone: waiting for a decode group would only add latency

    def __init__(self, pipe, device, dtype, config=None):
        super().__init__(pipe, device, dtype, config)
        self._latents_mean, self._latents_std = video_vae_stats(self.pipe.vae, self.device)
        ratio = pipe.config.boundary_ratio
        self.boundary_timestep = None if ratio is None else ratio * pipe.scheduler.config.num_train_timesteps
        self.loras = LoraLibrary(pipe, self.config.lora.lora_dir or None, self.config.lora.max_loras)
        self.cache_steps: Counter = Counter()  # first-block cache decisions per request, branch and expert

    def counters(self) -> dict[str, float]:
        return {**super().counters(), "cache_steps_computed": self.cache_steps["computed"],
                "cache_steps_reused": self.cache_steps["reused"]}

    # -- the declaration, refined by the checkpoint ------------------------------------
    @property
    def experts(self) -> list:
        """[high-noise, low-noise] transformers (Wan2.1 and TI2V-5B: the one transformer)."""
        return [self.pipe.transformer] + ([self.pipe.transformer_2] if self.boundary_timestep is not None else [])

    @property
    def size_multiple(self) -> int:
        """The VAE's spatial factor times the patch (`__call__` would round other sizes down), at least 16."""
        return max(16, self.pipe.vae_scale_factor_spatial * self.pipe.transformer.config.patch_size[1])

    def input_specs(self) -> tuple[InputSpec, ...]:
        specs = self.inputs
        for name in ("height", "width"):
            specs = replace_spec(specs, name, low=self.size_multiple, multiple_of=self.size_multiple)
        if self.boundary_timestep is None:  # WanPipeline.check_inputs refuses it without boundary_ratio
            specs = replace_spec(specs, "guidance_scale_2", unused="this checkpoint has one transformer (no "
                                                                    "boundary_ratio)")
        return specs

    def check_inputs(self, params: SamplingParams) -> None:
        self.loras.check(params.lora_name)
        ratio = self.pipe.vae_scale_factor_temporal
        if (params.num_frames - 1) % ratio:  # `__call__` would round it down with a warning
            below = (params.num_frames - 1) // ratio * ratio + 1
            raise InvalidInputError("num_frames", f"{params.num_frames} must be {ratio}k + 1 (the VAE compresses "
                                    f"{ratio} frames into one latent frame); nearest: {below} or {below + ratio}")

    def request_cost(self, params: SamplingParams) -> int:
        """Latent tokens (after the transformer's patches) x CFG passes."""
        frames = (params.num_frames - 1) // self.pipe.vae_scale_factor_temporal + 1
        tokens = frames * (params.height // self.size_multiple) * (params.width // self.size_multiple)
        return tokens * (2 if self.do_cfg(params) else 1)

    @staticmethod
    def do_cfg(params: SamplingParams) -> bool:
        return params.guidance_scale > 1.0  # WanPipeline.do_classifier_free_guidance (for both experts)

    @staticmethod
    def row_lora(params: SamplingParams) -> RowLora:
        return (params.lora_name, float(params.lora_scale)) if params.lora_name else None

    # -- the step contract ------------------------------------------------------------
    @torch.inference_mode()
    def prepare_encode(self, state: WanState) -> None:
        p, pipe = state.params, self.pipe
        cfg = self.do_cfg(p)
        state.text = self.text_cache.get_or_encode(
            (self.name, p.prompt, cfg, p.negative_prompt if cfg else None, p.max_sequence_length),
            lambda: self.encode_sides(p, cfg))
        state.generator = torch.Generator(device=self.device).manual_seed(int(p.seed))
        # The copy is request-local: UniPC keeps its step index and the last model outputs on the object.
        state.scheduler = copy.deepcopy(pipe.scheduler)
        state.scheduler.set_timesteps(p.num_inference_steps, device=self.device)
        state.timesteps = state.scheduler.timesteps
        assert len(state.timesteps) == p.num_inference_steps, "total_steps assumes one timestep per step"
        self._prepare_latents(state)

    def _prepare_latents(self, state: WanState) -> None:
        """The request's noise, as `WanPipeline.prepare_latents` draws it (image to video adds its condition)."""
        p, pipe = state.params, self.pipe
        state.scheduler.set_begin_index(0)  # as WanPipeline.__call__
        state.latents = pipe.prepare_latents(1, pipe.transformer.config.in_channels, p.height, p.width, p.num_frames,
                                             torch.float32, self.device, state.generator)

    def expert(self, state: WanState) -> int:
        """0: the high-noise expert (`transformer`; every step without boundary_ratio), 1: the low-noise one."""
        t = state.timesteps[state.step_index]
        return 0 if self.boundary_timestep is None or t >= self.boundary_timestep else 1

    def _model_input(self, state: WanState) -> torch.Tensor:
        """The transformer's hidden states for this request (text to video: its latents)."""
        return state.latents.to(self.pipe.transformer.dtype)

    def _timestep(self, state: WanState) -> torch.Tensor:
        """[1] (or [1, tokens] with expand_timesteps: every token at t, where the mask is 1)."""
        t = state.timesteps[state.step_index]
        if not self.pipe.config.expand_timesteps:
            return t.expand(1)
        mask = state.mask if state.mask is not None else torch.ones_like(state.latents[:, :1])
        return (mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0)

    @torch.inference_mode()
    def denoise_step(self, input_batch: InputBatch, *, states: list[WanState]) -> torch.Tensor:
        """Each expert over its own rows (cond, then uncond for the rows with CFG); each row's guidance."""
        groups: dict[int, list[int]] = {}
        for i, state in enumerate(states):
            groups.setdefault(self.expert(state), []).append(i)
        pred: list[Optional[torch.Tensor]] = [None] * len(states)
        with self.loras.rows([self.row_lora(s.params) for s in states]):
            for expert, rows in groups.items():
                with self.loras.only(rows):
                    guided = self._guided(self.experts[expert], [states[i] for i in rows], expert)
                for i, value in zip(rows, guided):
                    pred[i] = value
        return torch.cat(pred)

    def _guided(self, model, members: list[WanState], expert: int) -> list[torch.Tensor]:
        """One expert's predictions for its rows: one forward over all of them, one over those with CFG."""
        cond = self._forward(model, members, "cond", expert)
        cfg = [i for i, s in enumerate(members) if "uncond" in s.text]
        guided = list(cond.split(1))
        if cfg:
            with self.loras.only(cfg):
                uncond = self._forward(model, [members[i] for i in cfg], "uncond", expert).split(1)
            for i, u in zip(cfg, uncond):
                p = members[i].params
                scale = p.guidance_scale if expert == 0 or p.guidance_scale_2 is None else p.guidance_scale_2
                guided[i] = u + float(scale) * (guided[i] - u)
        return guided

    def _forward(self, model, members: list[WanState], side: str, expert: int) -> torch.Tensor:
        """One transformer call over `members`, as the pipeline makes it for one request (`side`: the text); with
        the first-block cache where a member asks for it, each request, branch and expert deciding alone (diffusers'
        hook keeps a state per cache context of each transformer)."""
        from engine_lib.pipelines.wan.first_block import cached_forward

        image = [s.image_embeds for s in members if s.image_embeds is not None]
        inputs = dict(hidden_states=torch.cat([self._model_input(s) for s in members]),
                      timestep=torch.cat([self._timestep(s) for s in members]),
                      encoder_hidden_states=torch.cat([s.text[side]["embeds"] for s in members]),
                      encoder_hidden_states_image=torch.cat(image) if image else None)
        groups = step_cache.row_groups(members, (f"{side}{expert}",), tally=self.cache_steps)
        if groups is not None:
            return cached_forward(model, self.loras, inputs["hidden_states"], inputs["timestep"],
                                  inputs["encoder_hidden_states"], inputs["encoder_hidden_states_image"], groups)
        with model.cache_context(side):
            return model(**inputs, attention_kwargs=None, return_dict=False)[0]

    @torch.inference_mode()
    def step_scheduler(self, state: WanState, noise_pred: torch.Tensor) -> None:
        t = state.timesteps[state.step_index]
        state.latents = state.scheduler.step(noise_pred, t, state.latents, return_dict=False)[0]
        state.step_index += 1

    @torch.inference_mode()
    def post_decode(self, states: list[WanState]) -> list[Outputs]:
        return [self._decode(s) for s in states]

    def _final_latents(self, state: WanState) -> torch.Tensor:
        return state.latents

    def _decode(self, state: WanState) -> Outputs:
        """The end of `__call__`: de-normalise, `vae.decode`, `postprocess_video` (float frames in [0, 1])."""
        vae = self.pipe.vae
        latents = self._final_latents(state).to(vae.dtype) / self._latents_std + self._latents_mean
        video = vae.decode(latents, return_dict=False)[0]
        return {"video": self.pipe.video_processor.postprocess_video(video, output_type="np"),
                "frame_rate": np.array([FRAME_RATE_FPS], dtype=np.float32)}

    def preview(self, state: WanState) -> Outputs:
        return {}  # progress only: step and num_steps


ADAPTER = WanAdapter
