"""LTX-2 text or image to video with audio behind the engine's contracts: `LTX2Pipeline.__call__` in phases.

Each request keeps its own packed video latents, audio latents, and a copy of the
scheduler for each (the pipeline's own split). One tick runs, over every
scheduled request at its own step, the guidance passes LTX-2 makes, each pass one
forward over the rows of the requests that need it:

* the main pass: `[uncond, cond]` rows for requests with CFG (video or audio scale
  > 1), `[cond]` for the others (the pipeline's `cache_context("cond_uncond")` call);
* spatio-temporal guidance (STG, `stg_scale` > 0): the cond rows with the
  self-attention of `spatio_temporal_guidance_blocks` bypassed;
* modality isolation (`modality_scale` > 1): the cond rows with audio-video
  cross-attention off;

then, per request, the pipeline's guidance formula in x0 space (CFG, STG and
modality deltas, guidance rescale), back to velocity, and both schedulers' steps.
Requests with different prompts, seeds, step counts and guidance settings share
these forwards; size, frame count, frame rate and text length (the shapes and
positions of the tokens) are in the keys. `post_decode` runs the video VAE, the
audio VAE and the vocoder per request.

Image to video (`LTX2ImageToVideoPipeline`, with an `image`): the image, re-compressed
as the pipeline does (H.264 at the checkpoint's CRF) and resized to height x width, is
VAE-encoded into the first latent frame; a conditioning mask (1 on that frame's tokens)
gives those tokens timestep 0 in every forward (`t * (1 - mask)`, one timestep per token)
and the scheduler steps only the other tokens, so the first frame stays the image's
latents. Both live in the request's state (`condition`). The transformer embeds each
token's own timestep, so a text-to-video row is the same row with every token at `t`:
a forward that holds an image request passes per-token timesteps for all its rows, and
requests with and without an image share it.

Sequence parallel (`sequence_parallel_size`): each transformer call runs on the ranks, its video and text
tokens split over them (video_sequence_parallel.py, with the plan of ltx2/context_parallel.py).

Not served: conditioning on other frames or videos (`LTX2ConditionPipeline`), a chosen
`image_crf`, prompt enhancement, the duration head (a request always says its
`num_frames`), `num_videos_per_prompt` > 1.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np
import torch

from engine_lib import interface
from engine_lib.config import EngineConfig
from engine_lib.host_copy import to_device
from engine_lib.interface import FRAME_RATE, VIDEO, InputSpec, OutputSpec, replace_spec
from engine_lib.pipelines import video_sequence_parallel
from engine_lib.pipelines.capabilities import make
from engine_lib.pipelines.base import DiffusersAdapter, InputBatch, Outputs, RequestState
from engine_lib.pipelines.ltx2 import context_parallel
from engine_lib.request import InvalidInputError, SamplingParams

STG_BLOCK = 28  # LTX2Pipeline.__call__'s spatio_temporal_guidance_blocks=[28] (the last block, if there are fewer)


def _scale(name: str, default: float, doc: str, low: float = 0.0) -> InputSpec:
    return InputSpec(name, "FP32", doc, default=default, low=low, high=interface.GUIDANCE_HIGH, batch="row", pipe_arg=name)


IMAGE = InputSpec("image", "BYTES", "image-to-video: the first frame (PNG, JPEG or WebP; resized to height x "
                  "width)", content="image", batch="row", pipe_arg="image")
LTX2_INPUTS = (
    interface.PROMPT,
    interface.NEGATIVE_PROMPT,
    replace(interface.HEIGHT, doc="frame height in pixels"),
    replace(interface.WIDTH, doc="frame width in pixels"),
    replace(interface.NUM_FRAMES, default=9, doc="video frames: 8k + 1 (8: the VAE's temporal compression)"),
    InputSpec("frame_rate", "FP32", "frames per second: the video's pace (positions and sound length follow it)",
              default=interface.VIDEO_FRAME_RATES["ltx2"], low=1, high=120, pipe_arg="frame_rate"),
    interface.NUM_INFERENCE_STEPS,
    interface.SEED,
    _scale("guidance_scale", 3.0, "video CFG scale: > 1 (or audio_guidance_scale > 1) runs the negative prompt"),
    _scale("stg_scale", 1.0, "video spatio-temporal guidance: > 0 (or audio_stg_scale > 0) runs a perturbed pass"),
    _scale("modality_scale", 3.0, "video modality guidance: > 1 (or audio_modality_scale > 1) runs an isolated pass"),
    _scale("guidance_rescale", 0.7, "rescales the guided video prediction towards the conditional one's std"),
    _scale("audio_guidance_scale", 7.0, "audio CFG scale (0: guidance_scale)"),
    _scale("audio_stg_scale", 1.0, "audio spatio-temporal guidance (0: stg_scale)"),
    _scale("audio_modality_scale", 3.0, "audio modality guidance (0: modality_scale)"),
    _scale("audio_guidance_rescale", 0.7, "audio guidance rescale (0: guidance_rescale)"),
    InputSpec("max_sequence_length", "INT32", "text tokens each prompt is encoded to", default=1024, low=1,
              high=1024, pipe_arg="max_sequence_length"),
    InputSpec("preview_interval", "INT32", "0: final response only; k: a progress response every k steps (step "
              "counts, no frames)", default=0, low=0, high=interface.INT_RANGES["INT32"][1], batch="row"),
    interface.output_format("mp4"),
    interface.PRIORITY,
    IMAGE,
)
AUDIO = OutputSpec("audio", "FP32", (-1, -1, -1), "sound [N, C, S] in [-1, 1] (muxed into video_mp4)",
                   pipe_output="audio")
AUDIO_SAMPLE_RATE = OutputSpec("audio_sample_rate", "INT32", (1,), "samples per second of `audio`")


@dataclass
class Guidance:
    """One request's guidance scales as the pipeline resolves them (an audio scale of 0 takes the video one)."""

    video: dict
    audio: dict

    @classmethod
    def of(cls, p: SamplingParams) -> "Guidance":
        names = ("guidance_scale", "stg_scale", "modality_scale", "guidance_rescale")
        return cls({n: float(p[n]) for n in names}, {n: float(p[f"audio_{n}"] or p[n]) for n in names})

    @property
    def cfg(self) -> bool:
        return self.video["guidance_scale"] > 1.0 or self.audio["guidance_scale"] > 1.0

    @property
    def stg(self) -> bool:
        return self.video["stg_scale"] > 0.0 or self.audio["stg_scale"] > 0.0

    @property
    def modality(self) -> bool:
        return self.video["modality_scale"] > 1.0 or self.audio["modality_scale"] > 1.0


@dataclass
class LTX2State(RequestState):
    """One request between steps: packed latents and a scheduler for each modality, text and positions."""

    generator: Optional[torch.Generator] = None
    guidance: Optional[Guidance] = None
    schedulers: dict = field(default_factory=dict)  # "video", "audio" -> request-local scheduler copies
    timesteps: Optional[torch.Tensor] = None
    latents: dict = field(default_factory=dict)  # "video" [1, S, C], "audio" [1, L, C*M] (float32)
    text: dict = field(default_factory=dict)  # "video", "audio" [rows, T, D], "mask" [rows, T]; rows: (uncond,) cond
    coords: dict = field(default_factory=dict)  # "video", "audio" positions of one row
    shape: dict = field(default_factory=dict)  # latent frames, height, width, audio frames, mel bins, fps
    # with an image: "latents" [1, h*w, C], the first latent frame's tokens (kept as they are), and "mask" [1, S]
    # (1 on those tokens), as LTX2ImageToVideoPipeline.prepare_latents makes them
    condition: dict = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return 1

    def step_inputs(self) -> dict[str, torch.Tensor]:
        return {"latents": self.latents["video"]}


class LTX2Adapter(DiffusersAdapter):
    """`LTX2Pipeline` (text to video with audio) and `LTX2ImageToVideoPipeline` (with an `image`), with request
    batching and step execution.

    Every guidance pass is one forward over all the requests that need it (see the module docstring).
    """

    name = "ltx2"
    pipeline_class = "LTX2Pipeline"
    cost_reference = {"height": 512, "width": 768, "num_frames": 121, "guidance_scale": 3.0}
    inputs = LTX2_INPUTS
    outputs = (VIDEO, AUDIO, AUDIO_SAMPLE_RATE, FRAME_RATE)
    state_class = LTX2State
    capabilities = make("request_batch", "step_execution", "previews", "image_input", "sequence_parallel")
    batched_decode = False  # each video decodes alone: waiting for a decode group would only add latency

    def __init__(self, pipe, device: torch.device, dtype: torch.dtype, config: Optional[EngineConfig] = None):
        super().__init__(pipe, device, dtype, config)
        self.stg_blocks = [min(STG_BLOCK, pipe.transformer.config.num_layers - 1)]

    # -- the declaration, refined by the checkpoint ------------------------------------
    @property
    def size_multiple(self) -> int:
        return max(32, self.pipe.vae_spatial_compression_ratio)  # LTX2Pipeline.check_inputs: multiples of 32

    def input_specs(self) -> tuple[InputSpec, ...]:
        specs = self.inputs
        for name in ("height", "width"):
            specs = replace_spec(specs, name, low=self.size_multiple, multiple_of=self.size_multiple)
        return specs

    def check_inputs(self, params: SamplingParams) -> None:
        self._check_token_shares(params)
        if params.image is not None and min(params.image.size) < 2:
            width, height = params.image.size
            raise InvalidInputError("image", f"{width}x{height} is too small: at least 2 pixels a side (the pipeline "
                                    "re-compresses it as an H.264 frame, whose sides it rounds down to even)")
        ratio = self.pipe.vae_temporal_compression_ratio
        if (params.num_frames - 1) % ratio:
            below = (params.num_frames - 1) // ratio * ratio + 1
            raise InvalidInputError("num_frames", f"{params.num_frames} must be {ratio}k + 1 (the VAE compresses "
                                    f"{ratio} frames into one latent frame); nearest: {below} or {below + ratio}")
        if self.audio_frames(params) < 1:
            raise InvalidInputError("num_frames", f"{params.num_frames} frames at frame_rate {params.frame_rate:g} "
                                    f"last {params.num_frames / params.frame_rate:.3f} s, shorter than "
                                    f"{0.5 / self.audio_latents_per_second:.3f} s, the least that gives the sound one "
                                    "latent frame: ask for more frames or a lower frame_rate")

    def _check_token_shares(self, params: SamplingParams) -> None:
        """Under sequence parallel every rank takes at least one text and one video token."""
        if self.workers is None:
            return
        degree = self.config.parallel.sequence_parallel_size
        mode = f"sequence_parallel_size={degree}"
        if params.max_sequence_length < degree:
            raise InvalidInputError("max_sequence_length", f"must be at least {degree} with {mode}")
        if self.video_tokens(params) < degree:
            raise InvalidInputError("height", f"the video must have at least {degree} latent tokens with {mode} "
                                    f"(one per {self.pipe.vae_spatial_compression_ratio} x "
                                    f"{self.pipe.vae_spatial_compression_ratio} pixels of each latent frame)")

    def start_workers(self, model_path: str):
        return video_sequence_parallel.start(type(self), model_path, self.device, self.dtype, self.config)

    @staticmethod
    def context_parallel_plan(transformer) -> dict:
        """On each sequence-parallel rank, before its parallelism is enabled: the plan, and the mask shim its
        attention needs (ltx2/context_parallel.py)."""
        context_parallel.one_head_masks()
        return context_parallel.plan(transformer)

    @property
    def audio_latents_per_second(self) -> float:
        pipe = self.pipe
        return pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)

    def audio_frames(self, params: SamplingParams) -> int:
        """Audio latent frames of the request's duration, as `__call__` rounds them."""
        return round(params.num_frames / params.frame_rate * self.audio_latents_per_second)

    def video_tokens(self, params: SamplingParams) -> int:
        """Latent video tokens of one row (patch size 1)."""
        spatial, temporal = self.pipe.vae_spatial_compression_ratio, self.pipe.vae_temporal_compression_ratio
        return ((params.num_frames - 1) // temporal + 1) * (params.height // spatial) * (params.width // spatial)

    def request_cost(self, params: SamplingParams) -> int:
        """Video tokens x the rows of the main pass (the largest forward)."""
        return self.video_tokens(params) * (2 if Guidance.of(params).cfg else 1)

    def pipe_kwargs(self, params: SamplingParams) -> dict:
        """`LTX2Pipeline`'s arguments; with an image, `LTX2ImageToVideoPipeline`'s (the decoded PIL image)."""
        kwargs = {**super().pipe_kwargs(params), "spatio_temporal_guidance_blocks": self.stg_blocks}
        if params.image is not None:
            kwargs["image"] = params.image.image
        return kwargs

    @functools.cached_property
    def image_to_video(self):
        """`LTX2ImageToVideoPipeline` on the same components: its image processing and `prepare_latents`."""
        from diffusers import LTX2ImageToVideoPipeline

        return LTX2ImageToVideoPipeline(**self.pipe.components)

    def _condition_latents(self, state: LTX2State, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed video latents (the image's in the first frame, noise after it) and the conditioning mask, as
        `LTX2ImageToVideoPipeline.__call__` makes them (the default CRF re-compression first)."""
        import PIL.Image
        from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf, resolve_default_image_crf

        p, pipe = state.params, self.image_to_video
        image, crf = p.image.image, resolve_default_image_crf(pipe.text_encoder)
        if crf:
            image = PIL.Image.fromarray(apply_image_conditioning_crf(np.array(image.convert("RGB")), crf))
        image = to_device(pipe.video_processor.preprocess(image, height=p.height, width=p.width), self.device, dtype)
        return pipe.prepare_latents(image, 1, pipe.transformer.config.in_channels, p.height, p.width, p.num_frames,
                                    0.0, torch.float32, self.device, state.generator)

    # -- the step contract ------------------------------------------------------------
    @torch.inference_mode()
    def prepare_encode(self, state: LTX2State) -> None:
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps
        from diffusers.pipelines.ltx2.utils import conditioning_frame_rate

        p, pipe = state.params, self.pipe
        state.guidance = Guidance.of(p)
        cfg = state.guidance.cfg
        state.text = self.text_cache.get_or_encode(
            (self.name, p.prompt, cfg, p.negative_prompt if cfg else None, p.max_sequence_length),
            lambda: self._encode(p, cfg))
        state.generator = torch.Generator(device=self.device).manual_seed(int(p.seed))
        frames = (p.num_frames - 1) // pipe.vae_temporal_compression_ratio + 1
        height, width = p.height // pipe.vae_spatial_compression_ratio, p.width // pipe.vae_spatial_compression_ratio
        if p.image is None:
            state.latents["video"] = pipe.prepare_latents(1, pipe.transformer.config.in_channels, p.height, p.width,
                                                          p.num_frames, 0.0, torch.float32, self.device,
                                                          state.generator)
        else:
            state.latents["video"], mask = self._condition_latents(state, state.text["rows"]["video"].dtype)
            # the first latent frame: one token per latent pixel (patch size 1, which the pipeline's mask needs)
            state.condition = {"latents": state.latents["video"][:, :height * width].clone(), "mask": mask}
        audio_frames = self.audio_frames(p)
        mel_bins = pipe.audio_vae.config.mel_bins
        state.latents["audio"] = pipe.prepare_audio_latents(
            1, num_channels_latents=pipe.audio_vae.config.latent_channels, audio_latent_length=audio_frames,
            num_mel_bins=mel_bins, noise_scale=0.0, dtype=torch.float32, device=self.device,
            generator=state.generator)
        fps = conditioning_frame_rate(p.frame_rate, 1.0)
        state.shape = dict(frames=frames, height=height, width=width, audio_frames=audio_frames,
                           mel_bins=mel_bins // pipe.audio_vae_mel_compression_ratio, fps=fps)
        steps = p.num_inference_steps
        sigmas = np.linspace(1.0, 1 / steps, steps)
        config = pipe.scheduler.config
        mu = calculate_shift(state.latents["video"].shape[1], config.get("base_image_seq_len", 1024),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.95),
                             config.get("max_shift", 2.05))
        state.schedulers = {"audio": copy.deepcopy(pipe.scheduler), "video": copy.deepcopy(pipe.scheduler)}
        retrieve_timesteps(state.schedulers["audio"], steps, self.device, None, sigmas=sigmas, mu=mu)
        state.timesteps, _ = retrieve_timesteps(state.schedulers["video"], steps, self.device, None, sigmas=sigmas,
                                                mu=mu)
        for scheduler in state.schedulers.values():
            scheduler.set_begin_index(0)
        state.coords = {
            "video": pipe.transformer.rope.prepare_video_coords(1, frames, height, width, self.device, fps=fps),
            "audio": pipe.transformer.audio_rope.prepare_audio_coords(1, audio_frames, self.device)}

    def _encode(self, p: SamplingParams, cfg: bool) -> dict:
        """Gemma, then the connectors, as `__call__` runs them: on `[negative, prompt]` with CFG."""
        embeds, mask, negative, negative_mask = self.pipe.encode_prompt(
            prompt=p.prompt, negative_prompt=p.negative_prompt, do_classifier_free_guidance=cfg,
            num_videos_per_prompt=1, max_sequence_length=p.max_sequence_length, device=self.device)
        if cfg:
            embeds, mask = torch.cat([negative, embeds], dim=0), torch.cat([negative_mask, mask], dim=0)
        padding_side = getattr(self.pipe.tokenizer, "padding_side", "left")
        video, audio, connector_mask = self.pipe.connectors(embeds, mask, padding_side=padding_side)
        return {"rows": {"video": video, "audio": audio, "mask": connector_mask}}

    def denoise_step(self, input_batch: InputBatch, *, states: list[LTX2State]) -> dict:
        """Every guidance pass over the rows that need it, then each request's guided velocities (one row each)."""
        main = self._forward([(s, self._rows(s)) for s in states], "cond_uncond")
        stg = self._forward([(s, [-1]) for s in states if s.guidance.stg], "uncond_stg",
                            spatio_temporal_guidance_blocks=self.stg_blocks)
        modality = self._forward([(s, [-1]) for s in states if s.guidance.modality], "uncond_modality",
                                 isolate_modalities=True)
        guided = [self._guide(s, main[s.request_id], stg.get(s.request_id), modality.get(s.request_id))
                  for s in states]
        return {kind: torch.cat([g[kind] for g in guided]) for kind in ("video", "audio")}

    @staticmethod
    def _rows(state: LTX2State) -> list[int]:
        """The text rows of the main pass: uncond and cond with CFG, cond alone without."""
        return [0, 1] if state.guidance.cfg else [0]

    def _forward(self, members: list[tuple[LTX2State, list[int]]], context: str, *,
                 spatio_temporal_guidance_blocks: Optional[list] = None,
                 isolate_modalities: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """One transformer call over the given text rows of each member (as the pipeline makes it for one
        request); request id -> its (video, audio) predictions, float32, one row per text row."""
        if not members:
            return {}
        # rows as slices: a list index is a host-to-device copy that waits, on CUDA ([r:][:1], not [r:r + 1]:
        # the guidance passes ask for row -1, the last)
        text = {k: torch.cat([s.text["rows"][k][r:][:1] for s, rows in members for r in rows])
                for k in ("video", "audio", "mask")}
        dtype = text["video"].dtype
        counts = [len(rows) for _, rows in members]

        def repeat(tensor_of) -> torch.Tensor:
            parts = [torch.cat([tensor_of(s)] * n) if n > 1 else tensor_of(s) for (s, _), n in zip(members, counts)]
            return torch.cat(parts)

        timestep = torch.cat([s.timesteps[s.step_index].expand(n) for (s, _), n in zip(members, counts)])
        video_timestep = timestep
        if any(s.condition for s, _ in members):  # one timestep per token, for every row (see the module docstring)
            video_timestep = torch.cat([self._token_timesteps(s).expand(n, -1) for (s, _), n in zip(members, counts)])
        shape = members[0][0].shape
        video, audio = video_sequence_parallel.transformer_call(
            self, context, hidden_states=repeat(lambda s: s.latents["video"]).to(dtype),
            audio_hidden_states=repeat(lambda s: s.latents["audio"]).to(dtype),
            encoder_hidden_states=text["video"], audio_encoder_hidden_states=text["audio"],
            timestep=video_timestep, audio_timestep=timestep, sigma=timestep, encoder_attention_mask=text["mask"],
            audio_encoder_attention_mask=text["mask"], num_frames=shape["frames"], height=shape["height"],
            width=shape["width"], fps=shape["fps"], audio_num_frames=shape["audio_frames"],
            video_coords=repeat(lambda s: s.coords["video"]), audio_coords=repeat(lambda s: s.coords["audio"]),
            isolate_modalities=isolate_modalities, spatio_temporal_guidance_blocks=spatio_temporal_guidance_blocks,
            perturbation_mask=None, use_cross_timestep=True, attention_kwargs=None, return_dict=False)
        out, start = {}, 0
        for (state, _), n in zip(members, counts):
            out[state.request_id] = (video[start:start + n].float(), audio[start:start + n].float())
            start += n
        return out

    @staticmethod
    def _token_timesteps(state: LTX2State) -> torch.Tensor:
        """[1, S]: the step's timestep for each video token; 0 on an image's first frame (`t * (1 - mask)`)."""
        t = state.timesteps[state.step_index]
        if not state.condition:
            return t.expand(1, state.latents["video"].shape[1])
        return t.unsqueeze(-1) * (1 - state.condition["mask"])

    def _guide(self, state: LTX2State, main, stg, modality) -> dict[str, torch.Tensor]:
        """The pipeline's guidance for one request: deltas in x0 space, rescale, back to velocity."""
        from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

        i, guided = state.step_index, {}
        for k, kind in enumerate(("video", "audio")):
            scheduler, latents, scales = state.schedulers[kind], state.latents[kind], getattr(state.guidance, kind)
            x0 = lambda pred: self.pipe.convert_velocity_to_x0(latents, pred, i, scheduler)  # noqa: E731
            if state.guidance.cfg:
                uncond, cond = main[k].chunk(2)
                cond, uncond = x0(cond), x0(uncond)
                cfg_delta = (scales["guidance_scale"] - 1) * (cond - uncond)
            else:
                cond, cfg_delta = x0(main[k]), 0
            stg_delta = scales["stg_scale"] * (cond - x0(stg[k])) if stg is not None else 0
            modality_delta = (scales["modality_scale"] - 1) * (cond - x0(modality[k])) if modality is not None else 0
            pred = cond + cfg_delta + stg_delta + modality_delta
            if scales["guidance_rescale"] > 0:
                pred = rescale_noise_cfg(pred, cond, guidance_rescale=scales["guidance_rescale"])
            guided[kind] = self.pipe.convert_x0_to_velocity(latents, pred, i, scheduler)
        return guided

    def step_scheduler(self, state: LTX2State, noise_pred: dict) -> None:
        """Both schedulers' steps; with an image, the video's steps only the tokens after the first frame, which
        stays the image's latents (the pipeline's `latents[:, :, 1:]`)."""
        t = state.timesteps[state.step_index]
        kept = state.condition["latents"].shape[1] if state.condition else 0
        stepped = state.schedulers["video"].step(noise_pred["video"][:, kept:], t, state.latents["video"][:, kept:],
                                                 return_dict=False)[0]
        state.latents["video"] = torch.cat([state.condition["latents"], stepped], dim=1) if kept else stepped
        state.latents["audio"] = state.schedulers["audio"].step(noise_pred["audio"], t, state.latents["audio"],
                                                                return_dict=False)[0]
        state.step_index += 1

    def post_decode(self, states: list[LTX2State]) -> list[Outputs]:
        return [self._decode(s) for s in states]

    def _decode(self, state: LTX2State) -> Outputs:
        """The video VAE, the audio VAE and the vocoder, exactly as the end of `__call__` (one request)."""
        from diffusers.utils.torch_utils import randn_tensor

        pipe, shape, p = self.pipe, state.shape, state.params
        transformer = pipe.transformer.config
        latents = pipe._unpack_latents(state.latents["video"], shape["frames"], shape["height"], shape["width"],
                                       transformer.patch_size, transformer.patch_size_t)
        audio = pipe._denormalize_audio_latents(state.latents["audio"], pipe.audio_vae.latents_mean,
                                                pipe.audio_vae.latents_std)
        audio = pipe._unpack_audio_latents(audio, shape["audio_frames"], num_mel_bins=shape["mel_bins"])
        latents = latents.to(state.text["rows"]["video"].dtype)
        timestep = None
        if pipe.vae.config.timestep_conditioning:  # decode_timestep = decode_noise_scale = 0.0 (the defaults)
            noise = randn_tensor(latents.shape, generator=state.generator, device=self.device, dtype=latents.dtype)
            timestep = torch.tensor([0.0], device=self.device, dtype=latents.dtype)
            scale = torch.tensor([0.0], device=self.device, dtype=latents.dtype)[:, None, None, None, None]
            latents = (1 - scale) * latents + scale * noise
        latents = pipe._denormalize_latents(latents, pipe.vae.latents_mean, pipe.vae.latents_std,
                                            pipe.vae.config.scaling_factor)
        video = pipe.vae.decode(latents.to(pipe.vae.dtype), timestep, return_dict=False)[0]
        video = pipe.video_processor.postprocess_video(video, output_type="np")
        mel = pipe.audio_vae.decode(audio.to(pipe.audio_vae.dtype), return_dict=False)[0]
        sound = pipe.vocoder(mel)
        return {"video": video, "audio": sound.float().cpu().numpy(),
                "audio_sample_rate": np.array([pipe.vocoder.config.output_sampling_rate], dtype=np.int32),
                "frame_rate": np.array([p.frame_rate], dtype=np.float32)}

    def preview(self, state: LTX2State) -> Outputs:
        return {}  # progress only: step and num_steps


ADAPTER = LTX2Adapter
