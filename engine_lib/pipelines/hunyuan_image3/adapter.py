"""HunyuanImage-3.0 behind the engine's step contract: `HunyuanImage3Pipeline`'s pieces, many requests per forward.

* `prepare_encode`: the request's sequence from the reference's template, its text part
  prefilled into the request's own KV cache (and the `<cfg>` one when guidance > 1), the
  noise from its seed, its shifted sigmas;
* `denoise_step`: the `<timestep>` and image tokens of every scheduled request (and its
  unconditional row) in one forward, each attending to its own cache; prompts of
  different lengths, images of different sizes and requests at different steps share it;
* `step_scheduler`: the request's Euler update `x + (sigma_next - sigma) * pred`;
* `post_decode`: the VAE, one call per image size.

`cache=first_block` (`step_cache.py`): each request and CFG branch decides from the first layer's residual of
its own image tokens, and its residuals stay in its state (`step_cache`).

`bot_task=think` / `recaption` (think.py) writes a text before the image, one token per tick: every request
in its text phase shares one forward (`Thinker.next_tokens`, each row against its own growing cache) beside
the tick's denoise forward. Its steps are `max_new_tokens` plus `num_inference_steps`; at an end token it
jumps to its first denoise step, its image context holding the text. New characters stream as intermediate
responses; the final response holds the whole text and its `finish_reason`.

Under tensor parallelism (tensor_parallel.py) the same code runs against the ranks: the pipeline's transformer
is a `RankedModel` and the text head the ranks' (`RankedTextHead`), so the KV caches of the prompt, the text and
the first-block cache's residuals live on the ranks; `release` frees them there.
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
from engine_lib.pipelines import step_cache
from engine_lib.pipelines.capabilities import make
from engine_lib.pipelines.base import InputBatch, Outputs, PipelineAdapter, RequestState
from engine_lib.pipelines.flow_match import IMAGE
from engine_lib.pipelines.decoder_parts import TextDecode, TextPhase, decode_by_grid, decode_text_rows, text_chunk
from engine_lib.pipelines.hunyuan_image3 import tensor_parallel
from engine_lib.pipelines.hunyuan_image3.pipeline import GENERATION_DEFAULTS, Context, HunyuanImage3Pipeline
from engine_lib.pipelines.hunyuan_image3.think import TASKS, TextHead, Thinker
from engine_lib.request import InvalidInputError, SamplingParams

HUNYUAN_INPUTS = (
    interface.PROMPT,
    replace(interface.HEIGHT, batch="row"),
    replace(interface.WIDTH, batch="row"),
    replace(interface.NUM_INFERENCE_STEPS, default=GENERATION_DEFAULTS["diff_infer_steps"],
            doc="denoising steps (default: the model folder's generation_config.json, else 4)"),
    interface.SEED,
    interface.output_format("png"),
    interface.PRIORITY,
    InputSpec("guidance_scale", "FP32", "CFG scale (diff_guidance_scale; default: generation_config.json's); "
              "<= 1: the conditional pass alone", default=GENERATION_DEFAULTS["diff_guidance_scale"], low=0,
              high=interface.GUIDANCE_HIGH, batch="row", pipe_arg="guidance_scale"),
    InputSpec("flow_shift", "FP32", "schedule shift s: sigma -> s sigma / (1 + (s - 1) sigma) (default: "
              "generation_config.json's)", default=GENERATION_DEFAULTS["flow_shift"], low=0.01, high=100, batch="row",
              pipe_arg="flow_shift"),
    *step_cache.CACHE_INPUTS,
    InputSpec("bot_task", "BYTES", "image, or first a text (sent as `text`) the image's context holds: think "
              "(reasoning, then a rewritten prompt) or recaption (a rewritten prompt)", default="image",
              choices=("image", *TASKS), high=16, batch="row"),
    InputSpec("max_new_tokens", "INT32", "most tokens of the think / recaption text", default=1024, low=1,
              high=8192, batch="row"),
    InputSpec("temperature", "FP32", "text sampling temperature; 0: greedy (the reference's default)", default=0.0,
              low=0, high=10, batch="row"),
)


@dataclass
class HunyuanState(TextPhase, RequestState):
    """One request between steps: its contexts, latents [C, h, w], sigmas and CFG scale."""

    context: Optional[Context] = None
    latents: Optional[torch.Tensor] = None
    sigmas: Optional[torch.Tensor] = None  # on the host: the Euler update reads them as scalars
    device_sigmas: Optional[torch.Tensor] = None  # the model's timesteps
    scale: float = 1.0
    step_cache: dict = field(default_factory=dict)  # "cond" / "uncond" -> its first-block cache (BranchCache)
    text: Optional[TextDecode] = None  # think / recaption: the text, once its text phase starts
    text_context: list = field(default_factory=list)  # the text phase's context ids
    streamed: str = ""  # the text's characters sent so far
    first_denoise_step: int = 0  # the step index of the first denoise step (after the text's steps)

    @property
    def num_rows(self) -> int:
        return 1

    def step_inputs(self) -> dict[str, torch.Tensor]:
        return {"latents": self.latents.flatten(1).T[None]}  # [1, h*w, C]: gathered right-padded


class HunyuanImage3Adapter(PipelineAdapter):
    """HunyuanImage-3.0 text to image (our own model code, engine_lib/pipelines/hunyuan_image3/) with step batching."""

    name = "hunyuan_image3"
    cost_reference = {"height": 1024, "width": 1024, "guidance_scale": 5.0}
    inputs = HUNYUAN_INPUTS
    outputs = (IMAGE, interface.TEXT, interface.FINISH_REASON)
    state_class = HunyuanState
    # served with step execution only; tensor_parallel.py: heads, MLPs and experts split over the ranks
    capabilities = make("step_execution", "first_block", "text", "tensor_parallel", "expert_parallel")

    @classmethod
    def load(cls, model_path: str, device: torch.device, dtype: torch.dtype,
             config: Optional[EngineConfig] = None) -> "HunyuanImage3Adapter":
        """With tensor_parallel_size > 1 the transformer is the ranks' (`start_workers`): not loaded here."""
        ranked = config is not None and config.parallel.tensor_parallel_size > 1
        model = tensor_parallel.ranked_model(model_path) if ranked else None
        pipe = HunyuanImage3Pipeline.from_pretrained(model_path, dtype=dtype, device=device, model=model)
        pipe.text_head = (tensor_parallel.ranked_text_head(model_path) if ranked
                          else TextHead.load(model_path, pipe.model.config, device, dtype))
        return cls(pipe, torch.device(device), dtype, config)

    def start_workers(self, model_path: str):
        if self.config.parallel.tensor_parallel_size > 1:
            return tensor_parallel.start(self.pipe.model, model_path, self.device, self.dtype, self.config)
        return super().start_workers(model_path)

    def release(self, state: "HunyuanState") -> None:
        """The ranks drop the request's KV cache shards, its text's included (tensor parallel; in one process they
        go with the state)."""
        caches = [state.context.cond, state.context.uncond] if state.context is not None else []
        self.pipe.model.free([c for c in caches + [state.text and state.text.cache] if c is not None])

    def __init__(self, pipe: HunyuanImage3Pipeline, device: torch.device, dtype: torch.dtype,
                 config: Optional[EngineConfig] = None):
        super().__init__(pipe, device, dtype, config)
        self.cache_steps: Counter = Counter()  # first-block cache decisions per request and CFG branch
        head = getattr(pipe, "text_head", None)  # `load` reads it (the ranks' under tensor parallelism)
        self.thinker = Thinker(pipe, head) if head is not None else None

    def counters(self) -> dict[str, float]:
        return {**super().counters(), "cache_steps_computed": self.cache_steps["computed"],
                "cache_steps_reused": self.cache_steps["reused"]}

    def input_specs(self) -> tuple[InputSpec, ...]:
        """Sizes in whole tokens up to the largest bucket; step count, guidance and shift default to the
        model's generation config."""
        generation, size = self.pipe.generation, self.pipe.token_size
        largest = max(max(s) for s in self.pipe.sizes())
        specs = replace_spec(self.inputs, "num_inference_steps", default=int(generation["diff_infer_steps"]))
        specs = replace_spec(specs, "guidance_scale", default=float(generation["diff_guidance_scale"]))
        specs = replace_spec(specs, "flow_shift", default=float(generation["flow_shift"]))
        for name in ("height", "width"):
            specs = replace_spec(specs, name, low=size, multiple_of=size, high=largest)
        return specs

    def check_inputs(self, params: SamplingParams) -> None:
        """The reference snaps a size to its aspect-ratio bucket; we serve only sizes it generates as asked."""
        size = (params.height, params.width)
        if self.pipe.snapped_size(*size) != size:
            near = sorted(self.pipe.sizes(), key=lambda s: abs(s[0] / s[1] - size[0] / size[1]))[:4]
            raise InvalidInputError("height", f"{size[0]}x{size[1]} is not one of this model's sizes; nearest "
                                              "aspect ratios: " + ", ".join(f"{h}x{w}" for h, w in near))
        if params.bot_task != "image" and self.thinker is None:
            raise InvalidInputError("bot_task", f"{params.bot_task} needs the text head (lm_head, model.ln_f), which "
                                                "this model folder lacks")

    def total_steps(self, params: SamplingParams) -> int:
        """A think / recaption text's steps come before the image's denoise steps."""
        return int(params.num_inference_steps) + (int(params.max_new_tokens) if params.bot_task != "image" else 0)

    def request_cost(self, params: SamplingParams) -> int:
        tokens = (params.height // self.pipe.token_size) * (params.width // self.pipe.token_size) + 1
        return tokens * (2 if params.guidance_scale > 1 else 1)

    # -- the step contract -----------------------------------------------------------------
    @torch.inference_mode()
    def prepare_encode(self, state: HunyuanState) -> None:
        p = state.params
        state.scale = float(p.guidance_scale)
        if p.bot_task != "image":
            state.text_context = self.thinker.text_ids(p.prompt, p.bot_task)
            state.text = self.thinker.start(state.text_context, p.max_new_tokens, p.temperature, p.seed)
            state.latents = torch.zeros(self.pipe.model.config.latent_channels, 1, 1, device=self.device)
            return
        state.context = self.pipe.encode(p.prompt, p.height, p.width, cfg=state.scale > 1.0)
        self._start_image(state)

    def _start_image(self, state: HunyuanState) -> None:
        """The noise and schedule of the image (after its text, if any)."""
        p = state.params
        state.first_denoise_step = state.num_steps - p.num_inference_steps
        state.step_index = max(state.step_index, state.first_denoise_step)
        state.latents = self.pipe.initial_noise(p.seed, state.context)
        state.sigmas = self.pipe.sigmas(p.num_inference_steps, p.flow_shift)
        state.device_sigmas = state.sigmas.to(self.device)  # (admission: a copy here may wait)

    @torch.inference_mode()
    def denoise_step(self, input_batch: InputBatch, *, states: list[HunyuanState]) -> dict:
        """One forward for the requests in their text phase (each one's next token and the keys and values of the
        one fed: `token` [B] and `kv` [B, 1, ...], -1 and zeros elsewhere), one for the denoising ones (each one's
        guided prediction as tokens, right-padded like the gathered latents: `pred` [B, N_max, C])."""
        texts = [i for i, s in enumerate(states) if s.decoding]
        out = {"pred": torch.zeros_like(input_batch["latents"]),
               **decode_text_rows(self.thinker, states, texts)}
        images = [i for i, s in enumerate(states) if not s.decoding]
        if not images:
            return out
        denoising = [states[i] for i in images]
        contexts = [s.context for s in denoising]
        key = ("rows", tuple(images))
        rows = input_batch.cache.get(key)  # padded caches, masks and RoPE: rebuilt only when the rows change
        if rows is None:
            input_batch.cache.clear()
            rows = input_batch.cache[key] = self.pipe.image_rows(contexts)
        preds = self.pipe.predict(contexts, [s.latents for s in denoising],
                                  [s.device_sigmas[s.denoise_index] for s in denoising],
                                  [s.scale for s in denoising], rows, self._row_groups(denoising))
        for i, pred in zip(images, preds):
            out["pred"][i, :pred[0].numel()] = pred.flatten(1).T
        return out

    def _row_groups(self, states: list[HunyuanState]) -> Optional[list[step_cache.RowGroup]]:
        """One group per row of `rows_of` (every conditional row, then the unconditional ones), each its request's
        CFG branch with its own image tokens; None when no request caches."""
        if not any(step_cache.caches(s.params) for s in states):
            return None
        rows = [(s, "cond") for s in states] + [(s, "uncond") for s in states if s.context.uncond is not None]
        return [step_cache.RowGroup(slice(r, r + 1), step_cache.threshold(s.params) if on else None,
                                    s.step_cache.setdefault(branch, step_cache.BranchCache()) if on else None,
                                    s.latents[0].numel(), self.cache_steps if on else None)
                for r, (s, branch) in enumerate(rows) for on in [step_cache.caches(s.params)]]

    @torch.inference_mode()
    def step_scheduler(self, state: HunyuanState, noise_pred: dict) -> None:
        if not state.decoding:
            pred = noise_pred["pred"][0].T.reshape(state.latents.shape)
            i = state.denoise_index
            state.latents = state.latents + pred * (state.sigmas[i + 1] - state.sigmas[i])
            state.step_index += 1
            return
        kv = noise_pred.get("kv")  # none under tensor parallelism: the ranks grew the cache
        self.thinker.advance(state.text, int(noise_pred["token"][0]), None if kv is None else kv[0, 0])
        state.step_index += 1
        if not state.text.done:
            return
        p = state.params
        # the text, decoded and re-encoded, in the image's context (the reference's cot_text)
        state.context = self.thinker.context(p.prompt, self._text(state), p.height, p.width, cfg=state.scale > 1.0)
        self.pipe.model.free([state.text.cache])  # its keys and values are no longer read
        state.text.cache = None
        self._start_image(state)

    def _text(self, state: HunyuanState) -> str:
        return self.thinker.thought(state.text_context, state.text)

    def chunk_outputs(self, state: HunyuanState) -> Optional[Outputs]:
        """The text's characters since the last call (a partial UTF-8 character at the end waits for its bytes)."""
        return text_chunk(state, self._text(state)) if state.text is not None else None

    @torch.inference_mode()
    def post_decode(self, states: list[HunyuanState]) -> list[Outputs]:
        outputs = decode_by_grid(states, lambda latents, grid: self.pipe.decode(latents))
        for state, named in zip(states, outputs):
            if state.text is not None:
                named["text"] = np.array([self._text(state)], dtype=object)
                stopped = state.text.ids[-1] in self.thinker.stops
                named["finish_reason"] = np.array(["stop" if stopped else "length"], dtype=object)
        return outputs


ADAPTER = HunyuanImage3Adapter
