"""BAGEL behind the engine's step contract: `BagelPipeline`'s pieces, many requests per forward.

* `prepare_encode`: the prompt prefilled into the request's own KV cache (the text-CFG
  context is empty), the initial noise from its seed, its shifted schedule;
* `denoise_step`: one forward over every scheduled request's latent tokens, each row
  attending only to its own cache (caches of different lengths and images of
  different sizes padded and masked), the CFG rows of every request whose timestep
  is inside its `cfg_interval` in the same forward; then each request's own CFG/renorm;
* `step_scheduler`: the request's Euler update `x - v * dt` (k updates for k steps);
* `post_decode`: unpack and decode, one VAE call per image size.

`cache=first_block` (`step_cache.py`): each request and CFG branch decides from the first layer's residual of
its own latent tokens, and its residuals stay in its state (`step_cache`).

Every input is per row, so prompts, sizes, step counts, CFG settings and join times
all share forwards.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from engine_lib import interface
from engine_lib.interface import InputSpec, replace_spec
from engine_lib.pipelines.bagel.pipeline import RENORM_TYPES, BagelPipeline, Context, Guidance
from engine_lib.pipelines import step_cache
from engine_lib.pipelines.base import InputBatch, Outputs, PipelineAdapter, RequestState
from engine_lib.pipelines.flow_match import IMAGE
from engine_lib.pipelines.decoder_parts import decode_by_grid
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
    InputSpec("cfg_img_scale", "FP32", "image CFG scale (text to image has no image context: it scales towards "
              "the conditional velocity)", default=1.0, low=0, high=interface.GUIDANCE_HIGH, batch="row",
              pipe_arg="cfg_img_scale"),
    InputSpec("cfg_interval", "FP32", "CFG runs at timesteps t with start < t <= end (t falls from 1 to 0)",
              default=(0.4, 1.0), low=0, high=1, count=2, batch="row", pipe_arg="cfg_interval"),
    InputSpec("cfg_renorm_type", "BYTES", "how the guided velocity is rescaled to the conditional one's norm",
              default="global", choices=RENORM_TYPES, high=16, batch="row", pipe_arg="cfg_renorm_type"),
    InputSpec("cfg_renorm_min", "FP32", "lower clamp of the renorm factor", default=0.0, low=0, high=1, batch="row",
              pipe_arg="cfg_renorm_min"),
    InputSpec("timestep_shift", "FP32", "schedule shift s: t -> s t / (1 + (s - 1) t)", default=3.0, low=0.01,
              high=100, batch="row", pipe_arg="timestep_shift"),
    *step_cache.CACHE_INPUTS,
)


@dataclass
class BagelState(RequestState):
    """One request between steps: its contexts, packed latents [N, 64], schedule and CFG settings."""

    context: Optional[Context] = None
    latents: Optional[torch.Tensor] = None
    timesteps: Optional[torch.Tensor] = None  # on the host: CFG decisions read them every step
    device_timesteps: Optional[torch.Tensor] = None  # the same on the device, for the forward
    dts: Optional[torch.Tensor] = None
    guidance: Guidance = field(default_factory=Guidance)
    step_cache: dict = field(default_factory=dict)  # "cond" / "uncond" -> its first-block cache (BranchCache)

    @property
    def num_rows(self) -> int:
        return 1

    def step_inputs(self) -> dict[str, torch.Tensor]:
        return {"latents": self.latents[None]}  # gathered right-padded to the batch's largest image

    def cfg_now(self) -> bool:
        return self.guidance.active(float(self.timesteps[self.step_index]))


class BagelAdapter(PipelineAdapter):
    """BAGEL text to image (our own model code, engine_lib/pipelines/bagel/model.py) with step batching."""

    name = "bagel"
    cost_reference = {"height": 1024, "width": 1024, "guidance_scale": 4.0}  # the official example's
    inputs = BAGEL_INPUTS
    outputs = (IMAGE,)
    state_class = BagelState
    supports_request_batch = False  # served with step execution only
    supports_step_execution = True

    @classmethod
    def load(cls, model_path: str, device: torch.device, dtype: torch.dtype,
             options: Optional[dict] = None) -> "BagelAdapter":
        return cls(BagelPipeline.from_pretrained(model_path, dtype=dtype, device=device), torch.device(device), dtype,
                   options)

    def __init__(self, pipe: BagelPipeline, device: torch.device, dtype: torch.dtype, options: Optional[dict] = None):
        super().__init__(pipe, device, dtype, options)
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

    def request_cost(self, params: SamplingParams) -> int:
        tokens = (params.height // self.pipe.downsample) * (params.width // self.pipe.downsample) + 2
        return tokens * (2 if params.guidance_scale > 1 else 1)

    # -- the step contract -----------------------------------------------------------------
    @torch.inference_mode()
    def prepare_encode(self, state: BagelState) -> None:
        p = state.params
        state.context = self.pipe.encode(p.prompt, p.height, p.width)
        state.latents = self.pipe.initial_noise(p.seed, state.context)
        state.timesteps, state.dts = self.pipe.schedule(p.num_inference_steps, p.timestep_shift)
        state.device_timesteps = state.timesteps.to(self.device)  # (admission: a copy here may wait)
        state.guidance = Guidance(p.guidance_scale, p.cfg_img_scale, tuple(p.cfg_interval), p.cfg_renorm_type,
                                  p.cfg_renorm_min)

    @torch.inference_mode()
    def denoise_step(self, input_batch: InputBatch, *, states: list[BagelState]) -> torch.Tensor:
        """Every request's guided velocity, right-padded like the gathered latents: [B, N_max, 64]."""
        with_uncond = tuple(s.cfg_now() for s in states)
        rows = input_batch.cache.get(with_uncond)  # the padded caches, rebuilt only when the rows change
        if rows is None:
            input_batch.cache.clear()
            rows = input_batch.cache[with_uncond] = self.pipe.query_rows([s.context for s in states], with_uncond)
        latents = input_batch["latents"]
        velocities = self.pipe.predict(rows, latents, [s.device_timesteps[s.step_index] for s in states],
                                       [s.guidance for s in states], with_uncond, [len(s.latents) for s in states],
                                       self._row_groups(states, with_uncond))
        out = torch.zeros_like(latents)
        for i, v in enumerate(velocities):
            out[i, :len(v)] = v
        return out

    def _row_groups(self, states: list[BagelState], with_uncond: tuple) -> Optional[list[step_cache.RowGroup]]:
        """One group per row of `query_rows` (every conditional row, then the unconditional ones), each its
        request's CFG branch with its own latent tokens; None when no request caches."""
        if not any(step_cache.caches(s.params) for s in states):
            return None
        rows = [(s, "cond") for s in states] + [(s, "uncond") for s, u in zip(states, with_uncond) if u]
        return [step_cache.RowGroup(slice(r, r + 1), step_cache.threshold(s.params) if on else None,
                                    s.step_cache.setdefault(branch, step_cache.BranchCache()) if on else None,
                                    len(s.latents), self.cache_steps if on else None)
                for r, (s, branch) in enumerate(rows) for on in [step_cache.caches(s.params)]]

    @torch.inference_mode()
    def step_scheduler(self, state: BagelState, noise_pred: torch.Tensor) -> None:
        state.latents = state.latents - noise_pred[0] * state.dts[state.step_index]
        state.step_index += 1

    @torch.inference_mode()
    def post_decode(self, states: list[BagelState]) -> list[Outputs]:
        return decode_by_grid(states, self.pipe.decode)


ADAPTER = BagelAdapter
