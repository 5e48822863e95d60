"""BAGEL behind the engine's step contract: `BagelPipeline`'s pieces, many requests per forward.

* `prepare_encode`: the prompt prefilled into the request's own KV cache (the text-CFG
  context is empty), the initial noise from its seed, its shifted schedule;
* `denoise_step`: one forward over every scheduled request's latent tokens, each row
  attending only to its own cache (caches of different lengths and images of
  different sizes padded and masked), the CFG rows of every request whose timestep
  is inside its `cfg_interval` in the same forward (after a thought with cfg_img_scale > 1,
  an image-CFG row too, against the context without the thought, as the reference
  guides); then each request's own CFG/renorm;
* `step_scheduler`: the request's Euler update `x - v * dt` (k updates for k steps);
* `post_decode`: unpack and decode, one VAE call per image size.

Text (`output_modality=text`: an answer; `think`: a thought before the image or the
answer) runs as steps too: a request in its text phase decodes one token per tick,
and every such request of a tick shares one forward (`BagelPipeline.next_tokens`,
each row against its own growing cache), beside the tick's denoise forward. Its
steps are `max_new_tokens` (plus `num_inference_steps` for an image); at
`<|im_end|>` it jumps to its first denoise step (or to its end). New characters
stream as intermediate responses (`chunk_outputs`); the final response holds the
whole text and its `finish_reason` (`stop` at `<|im_end|>`, `length` at the cap).

`cache=first_block` (`step_cache.py`): each request and CFG branch decides from the first layer's residual of
its own latent tokens, and its residuals stay in its state (`step_cache`).

Every input is per row, so prompts, sizes, step counts, CFG settings and join times
all share forwards.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np
import torch

from engine_lib import interface
from engine_lib.config import EngineConfig
from engine_lib.interface import InputSpec, replace_spec
from engine_lib.pipelines.bagel.pipeline import (GEN_THINK_SYSTEM_PROMPT, RENORM_TYPES, VLM_THINK_SYSTEM_PROMPT,
                                                 BagelPipeline, Context, Guidance, TextDecode, with_img)
from engine_lib.pipelines import step_cache
from engine_lib.pipelines.capabilities import make
from engine_lib.pipelines.base import InputBatch, Outputs, PipelineAdapter, RequestState
from engine_lib.pipelines.flow_match import IMAGE
from engine_lib.pipelines.decoder_parts import TextPhase, decode_by_grid, decode_text_rows, text_chunk
from engine_lib.request import InvalidInputError, SamplingParams

# The official inferencer's text-to-image settings are the defaults.
BAGEL_INPUTS = (
    interface.PROMPT,
    replace(interface.HEIGHT, batch="row"),
    replace(interface.WIDTH, batch="row"),
    interface.NUM_INFERENCE_STEPS,
    interface.SEED,
    interface.output_format("png"),
    interface.PRIORITY,
    InputSpec("guidance_scale", "FP32", "text CFG scale (BAGEL's cfg_text_scale); <= 1: no CFG", default=4.0, low=0,
              high=interface.GUIDANCE_HIGH, batch="row", pipe_arg="guidance_scale"),
    InputSpec("cfg_img_scale", "FP32", "image CFG scale: away from the velocity without images (text to image: "
              "the conditional one; after think: the prompt's without the thought)", default=1.0, low=0,
              high=interface.GUIDANCE_HIGH, batch="row", pipe_arg="cfg_img_scale"),
    InputSpec("cfg_interval", "FP32", "CFG runs at timesteps t with start < t <= end (t falls from 1 to 0)",
              default=(0.4, 1.0), low=0, high=1, count=2, batch="row", pipe_arg="cfg_interval"),
    InputSpec("cfg_renorm_type", "BYTES", "how the guided velocity is rescaled to the conditional one's norm",
              default="global", choices=RENORM_TYPES, high=16, batch="row", pipe_arg="cfg_renorm_type"),
    InputSpec("cfg_renorm_min", "FP32", "lower clamp of the renorm factor", default=0.0, low=0, high=1, batch="row",
              pipe_arg="cfg_renorm_min"),
    InputSpec("timestep_shift", "FP32", "schedule shift s: t -> s t / (1 + (s - 1) t)", default=3.0, low=0.01,
              high=100, batch="row", pipe_arg="timestep_shift"),
    *step_cache.CACHE_INPUTS,
    InputSpec("think", "BOOL", "first decode a plan (an image) or reasoning (a text answer), sent as `text`",
              default=False, batch="row"),
    InputSpec("output_modality", "BYTES", "image, or text: an answer to the prompt, no image",
              default="image", choices=("image", "text"), high=8, batch="row"),
    InputSpec("max_new_tokens", "INT32", "most tokens of the text (think mode's thought, or the answer)",
              default=999, low=1, high=4096, batch="row"),
    InputSpec("temperature", "FP32", "text sampling temperature; 0: greedy (the reference's default)", default=0.0,
              low=0, high=10, batch="row"),
)

@dataclass
class BagelState(TextPhase, RequestState):
    """One request between steps: its contexts, packed latents [N, 64], schedule and CFG settings."""

    context: Optional[Context] = None
    latents: Optional[torch.Tensor] = None
    timesteps: Optional[torch.Tensor] = None  # on the host: CFG decisions read them every step
    device_timesteps: Optional[torch.Tensor] = None  # the same on the device, for the forward
    dts: Optional[torch.Tensor] = None
    guidance: Guidance = field(default_factory=Guidance)
    step_cache: dict = field(default_factory=dict)  # "cond" / "uncond" / "img" -> its first-block cache (BranchCache)
    text: Optional[TextDecode] = None  # the thought or answer, once its text phase starts
    streamed: str = ""  # its characters sent so far
    first_denoise_step: int = 0  # the step index of the first denoise step (after a thought's steps)

    @property
    def num_rows(self) -> int:
        return 1

    def step_inputs(self) -> dict[str, torch.Tensor]:
        if self.decoding:  # one all-zero latent token stands in; its next token comes from the text forward
            return {"latents": torch.zeros(1, 1, TOKEN_DIM, device=self.context.cond.keys[0].device)}
        return {"latents": self.latents[None]}  # gathered right-padded to the batch's largest image

    def cfg_now(self) -> bool:
        return self.guidance.active(float(self.timesteps[self.denoise_index]))


TOKEN_DIM = 64  # BAGEL's packed latent token: 2 x 2 patches of 16 channels


class BagelAdapter(PipelineAdapter):
    """BAGEL text to image (our own model code, engine_lib/pipelines/bagel/model.py) with step batching."""

    name = "bagel"
    cost_reference = {"height": 1024, "width": 1024, "guidance_scale": 4.0}  # the official example's
    inputs = BAGEL_INPUTS
    outputs = (IMAGE, interface.TEXT, interface.FINISH_REASON)
    state_class = BagelState
    capabilities = make("step_execution", "first_block", "text")  # served with step execution only
    # Most requests that decode a token in one tick (None: every one in its text phase); the others in their text
    # phase wait, seated. Not a served parameter: the `think` benchmark's baseline sets 1.
    max_text_rows: Optional[int] = None

    @classmethod
    def load(cls, model_path: str, device: torch.device, dtype: torch.dtype,
             config: Optional[EngineConfig] = None) -> "BagelAdapter":
        return cls(BagelPipeline.from_pretrained(model_path, dtype=dtype, device=device), torch.device(device), dtype,
                   config)

    def __init__(self, pipe: BagelPipeline, device: torch.device, dtype: torch.dtype,
                 config: Optional[EngineConfig] = None):
        super().__init__(pipe, device, dtype, config)
        self.cache_steps: Counter = Counter()  # first-block cache decisions per request and CFG branch

    def counters(self) -> dict[str, float]:
        return {**super().counters(), "cache_steps_computed": self.cache_steps["computed"],
                "cache_steps_reused": self.cache_steps["reused"]}

    def input_specs(self) -> tuple[InputSpec, ...]:
        specs = self.inputs
        size = self.pipe.downsample
        for name in ("height", "width"):
            specs = replace_spec(specs, name, low=size, multiple_of=size, high=self.pipe.max_size)
        return specs

    def check_inputs(self, params: SamplingParams) -> None:
        start, end = params.cfg_interval
        if start > end:
            raise InvalidInputError("cfg_interval", f"start {start:g} is after end {end:g}")

    def total_steps(self, params: SamplingParams) -> int:
        """A text answer's steps are its tokens; a thought's come before the image's denoise steps."""
        if params.output_modality == "text":
            return int(params.max_new_tokens)
        return int(params.num_inference_steps) + (int(params.max_new_tokens) if params.think else 0)

    def request_cost(self, params: SamplingParams) -> int:
        if params.output_modality == "text":
            return 1
        tokens = (params.height // self.pipe.downsample) * (params.width // self.pipe.downsample) + 2
        if params.guidance_scale <= 1:
            return tokens
        return tokens * (3 if params.think and params.cfg_img_scale > 1 else 2)  # an image-CFG row after a thought

    # -- the step contract -----------------------------------------------------------------
    @torch.inference_mode()
    def prepare_encode(self, state: BagelState) -> None:
        p = state.params
        if p.output_modality == "text":
            state.context = self.pipe.encode(p.prompt, 0, 0, VLM_THINK_SYSTEM_PROMPT if p.think else "")
        else:
            state.context = self.pipe.encode(p.prompt, p.height, p.width, GEN_THINK_SYSTEM_PROMPT if p.think else "")
        if p.think or p.output_modality == "text":
            state.text = self.pipe.start_text(state.context.cond, p.max_new_tokens, p.temperature, p.seed)
        else:
            self._start_image(state)

    def _start_image(self, state: BagelState) -> None:
        """The noise, schedule and guidance of the image (after its thought, if any)."""
        p = state.params
        state.first_denoise_step = state.num_steps - p.num_inference_steps
        state.step_index = max(state.step_index, state.first_denoise_step)
        state.latents = self.pipe.initial_noise(p.seed, state.context)
        state.timesteps, state.dts = self.pipe.schedule(p.num_inference_steps, p.timestep_shift)
        state.device_timesteps = state.timesteps.to(self.device)  # (admission: a copy here may wait)
        state.guidance = Guidance(p.guidance_scale, p.cfg_img_scale, tuple(p.cfg_interval), p.cfg_renorm_type,
                                  p.cfg_renorm_min)

    @torch.inference_mode()
    def denoise_step(self, input_batch: InputBatch, *, states: list[BagelState]) -> dict:
        """One forward for the requests decoding text (each one's next token and the keys and values of the one
        fed, `token` [B] and `kv` [B, 1, ...], -1 and zeros elsewhere and for those `max_text_rows` leaves
        waiting), one for the denoising ones (each one's guided velocity, right-padded like the gathered latents:
        `velocity` [B, N_max, 64])."""
        latents = input_batch["latents"]
        texts = [i for i, s in enumerate(states) if s.decoding][:self.max_text_rows]
        out = {"velocity": torch.zeros_like(latents), **decode_text_rows(self.pipe, states, texts)}
        images = [i for i, s in enumerate(states) if not s.decoding]
        if not images:
            return out
        denoising = [states[i] for i in images]
        with_uncond = tuple(s.cfg_now() for s in denoising)
        img = tuple(with_img([s.context for s in denoising], with_uncond))
        key = (tuple(images), with_uncond, img)
        rows = input_batch.cache.get(key)  # the padded caches, rebuilt only when the rows change
        if rows is None:
            input_batch.cache.clear()
            rows = input_batch.cache[key] = self.pipe.query_rows([s.context for s in denoising], with_uncond)
        velocities = self.pipe.predict(rows, latents[images] if texts else latents,
                                       [s.device_timesteps[s.denoise_index] for s in denoising],
                                       [s.guidance for s in denoising], with_uncond,
                                       [len(s.latents) for s in denoising],
                                       self._row_groups(denoising, with_uncond, img), img)
        for i, v in zip(images, velocities):
            out["velocity"][i, :len(v)] = v
        return out

    def _row_groups(self, states: list[BagelState], with_uncond: tuple,
                    img: tuple) -> Optional[list[step_cache.RowGroup]]:
        """One group per row of `query_rows` (every conditional row, then the unconditional ones, then the
        image-CFG ones), each its request's CFG branch with its own latent tokens; None when no request caches."""
        if not any(step_cache.caches(s.params) for s in states):
            return None
        rows = [(s, "cond") for s in states] + [(s, "uncond") for s, u in zip(states, with_uncond) if u]
        rows += [(s, "img") for s, i in zip(states, img) if i]
        return [step_cache.RowGroup(slice(r, r + 1), step_cache.threshold(s.params) if on else None,
                                    s.step_cache.setdefault(branch, step_cache.BranchCache()) if on else None,
                                    len(s.latents), self.cache_steps if on else None)
                for r, (s, branch) in enumerate(rows) for on in [step_cache.caches(s.params)]]

    @torch.inference_mode()
    def step_scheduler(self, state: BagelState, noise_pred: dict) -> None:
        if not state.decoding:
            state.latents = state.latents - noise_pred["velocity"][0] * state.dts[state.denoise_index]
            state.step_index += 1
            return
        token = int(noise_pred["token"][0])
        if token < 0:  # not decoded this tick (max_text_rows)
            return
        self.pipe.advance(state.text, token, noise_pred["kv"][0, 0])
        state.step_index += 1
        if not state.text.done:
            return
        state.text.cache = None  # the thought's keys and values: the image's context holds it re-encoded
        if state.params.output_modality == "text":
            state.step_index = state.num_steps
            return
        # the thought, re-encoded, into the image's context (the reference's update_context_text)
        self.pipe.add_thought(state.context, self.pipe.text(state.text.ids), state.params.cfg_img_scale)
        self._start_image(state)

    def chunk_outputs(self, state: BagelState) -> Optional[Outputs]:
        """The text's characters since the last call (a partial UTF-8 character at the end waits for its bytes)."""
        return text_chunk(state, self.pipe.text(state.text.ids)) if state.text is not None else None

    @torch.inference_mode()
    def post_decode(self, states: list[BagelState]) -> list[Outputs]:
        images = [s for s in states if s.params.output_modality == "image"]
        decoded = iter(decode_by_grid(images, self.pipe.decode) if images else [])
        out = []
        for state in states:
            named = next(decoded) if state.params.output_modality == "image" else {}
            if state.text is not None:
                named["text"] = np.array([self.pipe.text(state.text.ids)], dtype=object)
                # `advance` keeps no end token, so a text that ended on one is under its cap
                capped = state.text.new_tokens >= state.text.max_new_tokens
                named["finish_reason"] = np.array(["length" if capped else "stop"], dtype=object)
            out.append(named)
        return out


ADAPTER = BagelAdapter
