"""Helios text to video behind the engine's step contract: `HeliosPipeline.__call__` cut into its phases.

Helios generates a video chunk by chunk: each chunk (9 latent frames, 33 video
frames) is denoised from fresh noise with its own schedule, conditioned on the
latents of the chunks before it (long, mid and short history windows), then
decoded on its own. So a request's steps are `num_inference_steps` x chunks,
each chunk sets its own timesteps when it starts, and each chunk is streamed as
soon as it is decoded (`chunk_outputs`), with its `frame_offset`; the final response
carries the whole video, which is those chunks end to end.

* `prepare_encode`: `encode_prompt` (T5; with CFG the negative prompt, "" when
  none), the empty history, the first chunk's noise and schedule;
* `denoise_step`: the pipeline's transformer call(s), cond then uncond, with the
  request's history windows;
* `step_scheduler`: the request's own `HeliosScheduler` copy; after a chunk's last
  step, its latents join the history and the next chunk's noise is drawn (the
  generator is used in the pipeline's order);
* `chunk_outputs`: `vae.decode` of the finished chunk, postprocessed as the
  pipeline does; `post_decode` only joins the chunks.

One active request at a time (`max_step_batch=1`). Sequence parallel
(`sequence_parallel_size`): each transformer call runs on the ranks, its tokens split over them
(video_sequence_parallel.py). Image and video conditioning (I2V, V2V) are not served.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import numpy as np
import torch

from engine_lib import interface
from engine_lib.interface import FRAME_OFFSET, FRAME_RATE, VIDEO, InputSpec, replace_spec
from engine_lib.config import ConfigError, EngineConfig
from engine_lib.pipelines import video_sequence_parallel
from engine_lib.pipelines.capabilities import make
from engine_lib.pipelines.base import DiffusersAdapter, InputBatch, Outputs, RequestState
from engine_lib.pipelines.helios import context_parallel
from engine_lib.pipelines.vae import video_vae_stats
from engine_lib.request import InvalidInputError, SamplingParams

FRAME_RATE_FPS = interface.VIDEO_FRAME_RATES["helios"]  # diffusers' Helios example exports at 24 fps
HISTORY_SIZES = [16, 2, 1]  # HeliosPipeline.__call__ defaults (long, mid, short history windows)
LATENT_FRAMES_PER_CHUNK = 9


def _frame_indices() -> dict[str, torch.Tensor]:
    """The frame indices of a chunk and its history windows (keep_first_frame=True), the same for every chunk."""
    prefix, long, mid, short_1x, hidden = torch.arange(0, sum([1, *HISTORY_SIZES, LATENT_FRAMES_PER_CHUNK])).split(
        [1, *HISTORY_SIZES, LATENT_FRAMES_PER_CHUNK], dim=0)
    return {"indices_hidden_states": hidden.unsqueeze(0),
            "indices_latents_history_short": torch.cat([prefix, short_1x], dim=0).unsqueeze(0),
            "indices_latents_history_mid": mid.unsqueeze(0),
            "indices_latents_history_long": long.unsqueeze(0)}


FRAME_INDICES = _frame_indices()

HELIOS_INPUTS = (
    interface.PROMPT,
    interface.NEGATIVE_PROMPT,
    replace(interface.HEIGHT, doc="frame height in pixels"),
    replace(interface.WIDTH, doc="frame width in pixels"),
    replace(interface.NUM_FRAMES, doc="video frames: whole chunks (33, 65, 97, 129, 165, ... with the shipped VAE)"),
    replace(interface.NUM_INFERENCE_STEPS, doc="denoising steps per chunk"),
    interface.SEED,
    InputSpec("guidance_scale", "FP32", "classifier-free guidance scale: > 1 runs the negative_prompt (or \"\") "
              "as a second pass", default=5.0, low=0, high=interface.GUIDANCE_HIGH, batch="row", pipe_arg="guidance_scale"),
    InputSpec("max_sequence_length", "INT32", "text tokens each prompt is encoded to", default=512, low=1, high=512,
              batch="row", pipe_arg="max_sequence_length"),
    InputSpec("preview_interval", "INT32", "0: chunk and final responses only; k: a progress response every k "
              "steps (step counts, no frames)", default=0, low=0, high=interface.INT_RANGES["INT32"][1], batch="row"),
    interface.output_format("mp4"),
    interface.PRIORITY,
)


@dataclass
class HeliosState(RequestState):
    """One request between steps: its text, its scheduler copy, the current chunk and the history before it."""

    generator: Optional[torch.Generator] = None
    scheduler: Any = None
    text: dict = field(default_factory=dict)  # "cond" (and "uncond") -> {"embeds": [1, L, D]}
    mu: float = 0.0
    latents: Optional[torch.Tensor] = None  # the chunk being denoised [1, C, 9, h, w]
    timesteps: Optional[torch.Tensor] = None  # the current chunk's
    history_latents: Optional[torch.Tensor] = None  # zeros, then every denoised chunk, float32
    history: dict = field(default_factory=dict)  # the current chunk's history windows (short, mid, long)
    image_latents: Optional[torch.Tensor] = None  # the first frame's latents, once the first chunk is done
    frames: list = field(default_factory=list)  # decoded chunks, float [1, f, H, W, 3]
    num_frames_out: int = 0  # frames of the final video (chunks past it are cut)
    chunk_done: bool = False  # a chunk finished its last step and waits for its decode

    @property
    def num_rows(self) -> int:
        return 1

    def step_inputs(self) -> dict[str, torch.Tensor]:
        return {"latents": self.latents}


class HeliosAdapter(DiffusersAdapter):
    """`HeliosPipeline` (text to video) with step execution, one request at a time, streamed chunk by chunk."""

    name = "helios"
    pipeline_class = "HeliosPipeline"
    cost_reference = {"height": 384, "width": 640, "num_frames": 132, "guidance_scale": 5.0}
    inputs = HELIOS_INPUTS
    outputs = (VIDEO, FRAME_OFFSET, FRAME_RATE)
    state_class = HeliosState
    # one active request at a time; previews: progress responses (no frames: a chunk is the preview)
    capabilities = make("step_execution", "previews", "sequence_parallel", max_step_batch=1)
    batched_decode = False  # each video decodes alone: waiting for a decode group would only add latency

    def __init__(self, pipe, device, dtype, config=None):
        super().__init__(pipe, device, dtype, config)
        self._latents_mean, self._latents_std = video_vae_stats(self.pipe.vae, self.device)

    def start_workers(self, model_path: str):
        if self.pipe.transformer.config.is_amplify_history:
            raise ConfigError(f"parameter 'sequence_parallel_size'={self.config.parallel.sequence_parallel_size}: "
                              "this Helios checkpoint amplifies its history keys (is_amplify_history), and where "
                              "they end is counted from the tokens of the forward, of which each rank holds a share")
        return video_sequence_parallel.start(type(self), model_path, self.device, self.dtype, self.config)

    @staticmethod
    def context_parallel_plan(transformer) -> dict:
        """On each sequence-parallel rank, before its parallelism is enabled (helios/context_parallel.py)."""
        return context_parallel.plan(transformer)

    # -- the declaration, refined by the checkpoint ------------------------------------
    @property
    def size_multiple(self) -> int:
        return 16  # HeliosPipeline.check_inputs

    @property
    def chunk_frames(self) -> int:
        """Video frames one chunk decodes to."""
        return (LATENT_FRAMES_PER_CHUNK - 1) * self.pipe.vae_scale_factor_temporal + 1

    def num_chunks(self, num_frames: int) -> int:
        return max(1, -(-num_frames // self.chunk_frames))

    def frames_of(self, chunks: int) -> int:
        """The frames HeliosPipeline returns for `chunks` chunks (it trims to 4k + 1)."""
        temporal = self.pipe.vae_scale_factor_temporal
        return (chunks * self.chunk_frames - 1) // temporal * temporal + 1

    def input_specs(self) -> tuple[InputSpec, ...]:
        specs = self.inputs
        for name in ("height", "width"):
            specs = replace_spec(specs, name, low=self.size_multiple, multiple_of=self.size_multiple)
        return replace_spec(specs, "num_frames", default=self.chunk_frames)

    def check_inputs(self, params: SamplingParams) -> None:
        """num_frames must be a length the pipeline generates (whole chunks, trimmed to 4k + 1): others would
        come back with a different frame count."""
        lengths = [self.frames_of(k) for k in range(1, self.num_chunks(params.num_frames) + 2)]
        if params.num_frames not in lengths:
            below = [n for n in lengths if n < params.num_frames][-1:]
            nearest = below + [n for n in lengths if n > params.num_frames][:1]
            raise InvalidInputError("num_frames", f"{params.num_frames} is not a length {self.name} generates "
                                    f"(whole chunks of {self.chunk_frames} frames); nearest: "
                                    f"{' or '.join(map(str, nearest))}")

    def total_steps(self, params: SamplingParams) -> int:
        return int(params.num_inference_steps) * self.num_chunks(params.num_frames)

    def request_cost(self, params: SamplingParams) -> int:
        """Latent tokens of one chunk x CFG passes."""
        tokens = LATENT_FRAMES_PER_CHUNK * (params.height // 16) * (params.width // 16)
        return tokens * (2 if self.do_cfg(params) else 1)

    @staticmethod
    def do_cfg(params: SamplingParams) -> bool:
        return params.guidance_scale > 1.0  # HeliosPipeline.do_classifier_free_guidance

    # -- the step contract ------------------------------------------------------------
    @torch.inference_mode()
    def prepare_encode(self, state: HeliosState) -> None:
        from diffusers.pipelines.helios.pipeline_helios import calculate_shift

        p, pipe = state.params, self.pipe
        state.text = self.text_cache.get_or_encode(
            (self.name, p.prompt, self.do_cfg(p), p.negative_prompt if self.do_cfg(p) else None, p.max_sequence_length),
            lambda: self.encode_sides(p, self.do_cfg(p)))
        state.generator = torch.Generator(device=self.device).manual_seed(int(p.seed))
        state.scheduler = copy.deepcopy(pipe.scheduler)
        channels, spatial = pipe.transformer.config.in_channels, pipe.vae_scale_factor_spatial
        state.history_latents = torch.zeros(1, channels, sum(HISTORY_SIZES), p.height // spatial, p.width // spatial,
                                            device=self.device, dtype=torch.float32)
        patch = pipe.transformer.config.patch_size
        image_seq_len = (LATENT_FRAMES_PER_CHUNK * (p.height // spatial) * (p.width // spatial)
                         // (patch[0] * patch[1] * patch[2]))
        config = pipe.scheduler.config
        state.mu = calculate_shift(image_seq_len, config.get("base_image_seq_len", 256),
                                   config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                                   config.get("max_shift", 1.15))
        state.num_frames_out = p.num_frames
        self._start_chunk(state)

    def _start_chunk(self, state: HeliosState) -> None:
        """The next chunk's history windows, noise and schedule, as the pipeline's chunk loop begins."""
        p, pipe = state.params, self.pipe
        long, mid, short_1x = state.history_latents[:, :, -sum(HISTORY_SIZES):].split(HISTORY_SIZES, dim=2)
        prefix = state.image_latents
        if prefix is None:
            prefix = torch.zeros((1, short_1x.shape[1], 1, *short_1x.shape[-2:]), device=self.device,
                                 dtype=short_1x.dtype)
        dtype = pipe.transformer.dtype
        state.history = {"short": torch.cat([prefix, short_1x], dim=2).to(dtype), "mid": mid.to(dtype),
                         "long": long.to(dtype)}
        state.latents = pipe.prepare_latents(1, pipe.transformer.config.in_channels, p.height, p.width,
                                             self.chunk_frames, dtype=torch.float32, device=self.device,
                                             generator=state.generator)
        sigmas = np.linspace(0.999, 0.0, p.num_inference_steps + 1)[:-1]
        state.scheduler.set_timesteps(p.num_inference_steps, device=self.device, sigmas=sigmas, mu=state.mu)
        state.timesteps = state.scheduler.timesteps
        assert len(state.timesteps) == p.num_inference_steps, "total_steps assumes one timestep per step"

    def denoise_step(self, input_batch: InputBatch, *, states: list[HeliosState]) -> torch.Tensor:
        [state] = states  # max_step_batch = 1
        t = state.timesteps[state.step_index % state.params.num_inference_steps]
        kwargs = dict(hidden_states=state.latents.to(self.pipe.transformer.dtype), timestep=t.expand(1),
                      **FRAME_INDICES, latents_history_short=state.history["short"],
                      latents_history_mid=state.history["mid"], latents_history_long=state.history["long"],
                      attention_kwargs=None, return_dict=False)
        call = video_sequence_parallel.transformer_call  # on the sequence-parallel ranks, if any
        pred = call(self, "cond", encoder_hidden_states=state.text["cond"]["embeds"], **kwargs)[0]
        if "uncond" in state.text:
            uncond = call(self, "uncond", encoder_hidden_states=state.text["uncond"]["embeds"], **kwargs)[0]
            pred = uncond + state.params.guidance_scale * (pred - uncond)
        return pred

    def step_scheduler(self, state: HeliosState, noise_pred: torch.Tensor) -> None:
        steps = state.params.num_inference_steps
        t = state.timesteps[state.step_index % steps]
        state.latents = state.scheduler.step(noise_pred, t, state.latents, generator=state.generator,
                                             return_dict=False)[0]
        state.step_index += 1
        if state.step_index % steps:
            return
        if state.image_latents is None:
            state.image_latents = state.latents[:, :, 0:1]
        state.history_latents = torch.cat([state.history_latents, state.latents], dim=2)
        state.chunk_done = True
        if not state.denoise_completed:
            self._start_chunk(state)  # draws the next chunk's noise, as the pipeline does after this decode

    def chunk_outputs(self, state: HeliosState) -> Optional[Outputs]:
        """The chunk that just finished, decoded and postprocessed as the pipeline does; frames past the final
        video's length are cut, so the chunks end to end are the final video."""
        if not state.chunk_done:
            return None
        state.chunk_done = False
        vae = self.pipe.vae
        chunk_latents = state.history_latents[:, :, -LATENT_FRAMES_PER_CHUNK:]
        video = vae.decode(chunk_latents.to(vae.dtype) / self._latents_std + self._latents_mean, return_dict=False)[0]
        offset = sum(f.shape[1] for f in state.frames)
        frames = self.pipe.video_processor.postprocess_video(video, output_type="np")[:, :state.num_frames_out - offset]
        state.frames.append(frames)
        return {"video": frames, "frame_offset": np.array([offset], dtype=np.int32),
                "frame_rate": np.array([FRAME_RATE_FPS], dtype=np.float32)}

    def post_decode(self, states: list[HeliosState]) -> list[Outputs]:
        """The chunks end to end (each was decoded as it finished)."""
        return [{"video": np.concatenate(s.frames, axis=1), "frame_rate": np.array([FRAME_RATE_FPS], dtype=np.float32)}
                for s in states]

    def preview(self, state: HeliosState) -> Outputs:
        return {}  # progress only: step and num_steps


ADAPTER = HeliosAdapter
