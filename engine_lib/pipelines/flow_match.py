"""What every flow-matching text-to-image adapter shares (Qwen-Image, Flux, SD3).

Their diffusers pipelines have the same `__call__` skeleton: encode the prompt(s),
draw latents, build timesteps on `FlowMatchEulerDiscreteScheduler`, loop
transformer forward (+ CFG) and `scheduler.step`, decode. `FlowMatchAdapter`
holds that skeleton once, cut into the step contract (the runner owns the loop):

* the declaration: the image inputs every one of them takes, one `image` output
  (png-encodable), sizes refined by the loaded VAE, the CFG part of the keys;
* `prepare_encode`: the adapter's `_encode`, a per-request generator, the adapter's
  `_initial_latents`, and `retrieve_timesteps` on a request-local scheduler copy;
* `denoise_step`: one transformer forward over all rows (each with its own
  timestep), CFG as one forward of 2B rows or two of B rows (`cfg_batching`), on
  the parallel ranks where there are some;
* `_forward`: the one choice of forward (diffusers' own, packed mixed sizes, first-block
  cached, or both), from the forwards the subclass supplies;
* `step_scheduler`, `post_decode` (one `vae.decode` per image size), `preview`
  (a latent->RGB projection measured from the model's own VAE).

A subclass supplies only what is pipeline-specific: its extra inputs, how it
encodes text, draws latents, sets its schedule, runs its transformer (diffusers'
call, and where it declares them its packed and cached forwards), and
unpacks/decodes latents.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch
import torch.nn.functional as F

from engine_lib import interface
from engine_lib.config import ConfigError, EngineConfig
from engine_lib.host_copy import to_device, to_uint8
from engine_lib.interface import InputSpec, OutputSpec, replace_spec
from engine_lib.lora import LORA_INPUTS, LoraLibrary, RowLora
from engine_lib.parallel import WorkerError
from engine_lib.pipelines import cfg_parallel, levers, rank_states, sequence_parallel, step_cache, taylorseer
from engine_lib.pipelines.base import DiffusersAdapter, InputBatch, Outputs, RequestState, Schedule
from engine_lib.pipelines.capabilities import make
from engine_lib.pipelines.rank_states import RowFacts
from engine_lib.request import InvalidInputError, SamplingParams
from engine_lib.sched.keys import RequestBatchKey, StepBatchKey, request_batch_key, step_batch_key

logger = logging.getLogger(__name__)

# The text tensors of one side (cond or uncond) of one request: "embeds" [N, L, D]
# plus whatever else the transformer takes per row ("mask" [N, L], "pooled" [N, P]).
TextParts = dict

IMAGE = OutputSpec("image", "UINT8", (-1, -1, -1, 3), "images [N, H, W, 3] (previews too)", encodings=("png",),
                   pipe_output="images")


@functools.lru_cache(maxsize=1024)
def strength_steps(num_inference_steps: int, strength: float) -> int:
    """The steps image-to-image runs at `strength`: the tail of the schedule, as diffusers' `get_timesteps`
    counts it (0 when the strength is too small for one step). Computed once per (steps, strength): validation,
    admission (the request's `num_steps`, which its state takes) and the request-mode key all read this one
    count."""
    init_timestep = min(num_inference_steps * strength, num_inference_steps)
    return num_inference_steps - int(max(num_inference_steps - init_timestep, 0))


def max_sequence_length(default: int, high: int) -> InputSpec:
    """Text tokens per prompt: the pipeline's `__call__` default and what its `check_inputs` allows."""
    return InputSpec("max_sequence_length", "INT32", "text tokens each prompt is encoded to (default: the "
                     "pipeline's, or the model's max_sequence_length parameter)", default=default, low=1, high=high,
                     batch="adapter", pipe_arg="max_sequence_length")



TRUE_CFG_SCALE = InputSpec("true_cfg_scale", "FP32", "true CFG scale: > 1 with a negative_prompt runs a second pass",
                           default=1.0, low=0, high=interface.GUIDANCE_HIGH, batch="adapter", pipe_arg="true_cfg_scale")
GUIDANCE_SCALE = InputSpec("guidance_scale", "FP32", "guidance scale", low=0, high=interface.GUIDANCE_HIGH,
                           pipe_arg="guidance_scale")
# The inputs every flow-matching image pipeline takes; subclasses add max_sequence_length and guidance.
IMAGE_INPUTS = (interface.PROMPT, interface.NEGATIVE_PROMPT, interface.HEIGHT, interface.WIDTH,
                interface.NUM_INFERENCE_STEPS, interface.SEED, interface.NUM_IMAGES, interface.PREVIEW_INTERVAL,
                interface.output_format("png"), interface.PRIORITY, *LORA_INPUTS)


@dataclass
class FlowMatchState(RequestState):
    """One request of a flow-matching image pipeline between steps."""

    generator: Optional[torch.Generator] = None
    scheduler: Any = None  # request-local copy of the diffusers scheduler
    schedule: Schedule = field(default_factory=Schedule)
    latents: Optional[torch.Tensor] = None  # rows = num_images
    text: dict = field(default_factory=dict)  # "cond" (and "uncond" with CFG) -> TextParts
    sigma_steps: Optional[torch.Tensor] = None  # dt of each Euler step: sigmas[i + 1] - sigmas[i]
    guidance: Optional[torch.Tensor] = None  # [1] float32 embedded guidance (guidance-distilled models only)
    begin_index: int = 0  # the schedule's first step in the scheduler's timesteps (image-to-image skips the head)
    step_cache: dict = field(default_factory=dict)  # CFG branch -> its step cache (step_cache.BranchCache, or
    # taylorseer.ModuleFactors per attention module)

    @property
    def num_rows(self) -> int:
        return 0 if self.latents is None else int(self.latents.shape[0])

    def step_inputs(self) -> dict[str, torch.Tensor]:
        timestep = self.schedule.timestep(self.step_index)
        return {"latents": self.latents, "timesteps": timestep.reshape(1).expand(self.num_rows)}


class FlowMatchAdapter(DiffusersAdapter):
    """The shared skeleton; see the module docstring for the split.

    Options: `cfg_batching` (default True): CFG cond and uncond as one forward of
    2B rows (False: two forwards of B rows); `max_sequence_length`: the text
    length used when a request leaves it unset (default: the pipeline's own);
    `lora_dir`, `max_loras` (engine_lib/lora.py).
    """

    outputs = (IMAGE,)
    state_class: ClassVar[type[FlowMatchState]] = FlowMatchState
    capabilities = make("request_batch", "step_execution", "previews", "lora")
    # "true_cfg": a negative_prompt and true_cfg_scale > 1 run a second pass (Qwen-Image, Flux);
    # "cfg": guidance_scale > 1 does, on the negative prompt or "" (SD3).
    cfg_kind: ClassVar[str] = "true_cfg"
    # Order of the two halves of a batched CFG forward: diffusers' SD3 puts the
    # negative first, Qwen-Image/Flux (two forwards there) are kept cond-first.
    cfg_order: ClassVar[tuple[str, str]] = ("cond", "uncond")
    # Padded text batches need a transformer that takes a text mask (Qwen-Image);
    # without one, equal text lengths are guaranteed by the keys instead.
    pads_text: ClassVar[bool] = False
    # Inputs (and key fields) the step key leaves out, with the `mixed_size_batching` option, because the adapter
    # batches their different values itself (Qwen-Image: height and width, with packed image tokens).
    step_key_skips: ClassVar[tuple[str, ...]] = ()
    # Inputs of `_row_inputs` the whole batch shares (one value, not one per row: Flux's text and image ids).
    batch_inputs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, pipe, device: torch.device, dtype: torch.dtype, config: Optional[EngineConfig] = None):
        super().__init__(pipe, device, dtype, config)
        self.cfg_batching = self.config.model.cfg_batching
        declared = self.input_spec("max_sequence_length")  # the pipeline's default and check_inputs limit
        self.max_sequence_length = int(self.config.model.max_sequence_length or declared.default)
        if not 1 <= self.max_sequence_length <= declared.high:
            raise ConfigError(f"parameter 'max_sequence_length': {self.max_sequence_length} must be in "
                              f"[1, {int(declared.high)}] for {self.name}")
        self._preview_weights: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._batched_step_exact: dict[tuple, bool] = {}  # (dtype, device type) -> step_batch equals per request
        self.loras = LoraLibrary(pipe, self.config.lora.lora_dir or None, self.config.lora.max_loras)
        self.mixed_size_batching = self.config.model.mixed_size_batching  # (refused where not declared)
        self.cache_steps: Counter = Counter()  # first-block cache decisions per request and CFG branch (step_cache.py)

    def counters(self) -> dict[str, float]:
        return {**super().counters(), "cache_steps_computed": self.cache_steps["computed"],
                "cache_steps_reused": self.cache_steps["reused"]}

    # -- limits --------------------------------------------------------------
    @property
    def size_multiple(self) -> int:
        """Height and width must be multiples of this (the VAE's downsampling, then 2x2 packing)."""
        return self.pipe.vae_scale_factor * 2

    @property
    def max_size(self) -> Optional[int]:
        """The largest height/width the transformer can take (None: only the config's limit)."""
        return None

    def input_specs(self) -> tuple[InputSpec, ...]:
        specs = replace_spec(self.inputs, "max_sequence_length", default=self.max_sequence_length)
        for name in ("height", "width"):
            specs = replace_spec(specs, name, low=self.size_multiple, multiple_of=self.size_multiple,
                                 high=self.max_size)
        return specs

    def text_length(self, params: SamplingParams) -> int:
        """The `max_sequence_length` this request is encoded with."""
        return int(params.max_sequence_length or self.max_sequence_length)

    def check_inputs(self, params: SamplingParams) -> None:
        self.loras.check(params.lora_name)
        degree = self.sequence_parallel_size
        mode = f"sequence_parallel_size={degree}"
        if self.workers is not None and degree > 1:  # every rank takes at least one text and one image token
            if self.text_length(params) < degree:
                raise InvalidInputError("max_sequence_length", f"must be at least {degree} with {mode}")
            if (params.height // self.size_multiple) * (params.width // self.size_multiple) < degree:
                raise InvalidInputError("height", f"the image must have at least {degree} tokens of "
                                        f"{self.size_multiple}x{self.size_multiple} pixels with {mode}")

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks that split each forward's tokens (1: none)."""
        return self.config.parallel.sequence_parallel_size

    def start_workers(self, model_path: str):
        if self.config.parallel.cfg_parallel:
            return cfg_parallel.start(type(self), model_path, self.device, self.dtype, self.config)
        if self.sequence_parallel_size > 1:
            return sequence_parallel.start(type(self), model_path, self.device, self.dtype, self.config)
        return super().start_workers(model_path)

    def release(self, state: FlowMatchState) -> None:
        """The ranks drop the request's step caches (they hold those of the forwards they run)."""
        if self.workers is not None and not self.workers.broken and rank_states.caches(state.params):
            try:
                self.workers.call_all("free", [([state.request_id],)] * self.workers.world_size)
            except WorkerError:
                pass  # the group is broken: the engine starts a new one, which holds nothing

    @staticmethod
    def row_lora(params: SamplingParams) -> RowLora:
        return (params.lora_name, float(params.lora_scale)) if params.lora_name else None

    def request_key(self, params: SamplingParams) -> RequestBatchKey:
        """Request mode: one LoRA (and scale) per wave, activated once for all of it."""
        return request_batch_key(params, self.key_inputs(), self.key_fields(params) + (("lora", self.row_lora(params)),))

    def step_key(self, params: SamplingParams) -> StepBatchKey:
        """Step mode: LoRAs apply per row, so they never split a batch; with mixed_size_batching, sizes neither."""
        skips = self.step_key_skips if self.mixed_size_batching else ()
        inputs = tuple(name for name in self.key_inputs() if name not in skips)
        return step_batch_key(params, inputs, tuple(f for f in self.key_fields(params) if f[0] not in skips))

    def request_cost(self, params: SamplingParams) -> int:
        """Image tokens (one per size_multiple x size_multiple pixels) x images x CFG passes."""
        tokens = (params.height // self.size_multiple) * (params.width // self.size_multiple)
        return tokens * params.num_images * (2 if self.do_cfg(params) else 1)

    def key_fields(self, params: SamplingParams) -> tuple:
        """CFG on/off and its scale shape the forward; without a text mask, so does the text length."""
        cfg = self.do_cfg(params)
        fields = (("cfg", cfg), ("cfg_scale", self.cfg_scale(params) if cfg else None))
        if not self.pads_text:
            fields += (("text_length", self.text_length(params)),)
        return fields

    # -- what a subclass supplies ------------------------------------------------
    def do_cfg(self, params: SamplingParams) -> bool:
        """Whether this request runs a second (unconditional) pass (as diffusers decides it)."""
        if self.cfg_kind == "cfg":
            return self.cfg_scale(params) > 1
        return params.negative_prompt is not None and params.true_cfg_scale > 1.0

    def cfg_scale(self, params: SamplingParams) -> float:
        return float(params.guidance_scale if self.cfg_kind == "cfg" else params.true_cfg_scale)

    def _encode(self, state: FlowMatchState) -> dict[str, TextParts]:
        """{"cond": parts, and "uncond": parts when do_cfg}, each for `num_images` rows."""
        raise NotImplementedError

    def _initial_latents(self, state: FlowMatchState) -> torch.Tensor:
        """The pipeline's `prepare_latents` with `state.generator` (may also fill the state's own fields)."""
        raise NotImplementedError

    def _timestep_kwargs(self, state: FlowMatchState) -> dict:
        """`retrieve_timesteps` arguments (sigmas, mu) as the pipeline computes them."""
        raise NotImplementedError

    def _row_inputs(self, states: list[FlowMatchState]) -> dict:
        """Per-row transformer inputs other than latents, timestep and text (tensors or lists, or None; those named
        in `batch_inputs` are the whole batch's)."""
        return {}

    def _transformer(self, latents: torch.Tensor, timestep: torch.Tensor, text: TextParts, rows: dict,
                     states: list[FlowMatchState]) -> torch.Tensor:
        """One transformer call, exactly as the pipeline's denoising loop makes it: `_forward`, under the
        TaylorSeer plan of the requests that ask for it (taylorseer.py)."""
        levers.onload(self.pipe.transformer)  # under offload=model: its blocks may run without its forward
        seer = taylorseer.plan(self.pipe.transformer, states, rows["branches"], self.cache_steps, self.loras)
        with taylorseer.attending(seer):
            return self._forward(latents, timestep, text, rows, states, seer)

    def _forward(self, latents: torch.Tensor, timestep: torch.Tensor, text: TextParts, rows: dict,
                 states: list[FlowMatchState], seer: Optional[taylorseer.Plan]) -> torch.Tensor:
        """The one choice of forward for every pipeline (`seer`: the TaylorSeer plan it runs under, or None):
        diffusers' own; rows of different sizes packed (`rows["packing"]`, under each token's own row's LoRA);
        with requests that cache the first block, the same forward whose blocks after the first run only over the
        row groups that compute (step_cache.py). A subclass supplies the forwards it runs, below."""
        packing = rows.get("packing")
        tokens = None if packing is None else [self._image_tokens(s) for s in states]
        groups = step_cache.row_groups(states, rows["branches"], tokens, self.cache_steps)
        if packing is None:
            if groups is None:
                return self._plain_forward(latents, timestep, text, rows, states)
            return self._cached_forward(latents, timestep, text, rows, states, groups, seer)
        with self.loras.packed(packing.token_rows):
            if groups is None:
                return self._packed_forward(latents, timestep, text, rows)
            return self._cached_packed_forward(latents, timestep, text, rows, groups)

    def _plain_forward(self, latents: torch.Tensor, timestep: torch.Tensor, text: TextParts, rows: dict,
                       states: list[FlowMatchState]) -> torch.Tensor:
        """The pipeline's transformer forward over rows of one size, as its denoising loop calls it."""
        raise NotImplementedError

    def _packed_forward(self, latents: torch.Tensor, timestep: torch.Tensor, text: TextParts,
                        rows: dict) -> torch.Tensor:
        """The forward over rows of different sizes, their image tokens packed by `rows["packing"]` (mixed_sizes)."""
        raise NotImplementedError

    def _cached_forward(self, latents: torch.Tensor, timestep: torch.Tensor, text: TextParts, rows: dict,
                        states: list[FlowMatchState], groups: list[step_cache.RowGroup],
                        seer: Optional[taylorseer.Plan]) -> torch.Tensor:
        """`_plain_forward` with the first-block cache decided per row group `groups` (first_block)."""
        raise NotImplementedError

    def _cached_packed_forward(self, latents: torch.Tensor, timestep: torch.Tensor, text: TextParts, rows: dict,
                               groups: list[step_cache.RowGroup]) -> torch.Tensor:
        """`_packed_forward` with the first-block cache decided per row group `groups` (first_block)."""
        raise NotImplementedError

    def _image_tokens(self, state: FlowMatchState) -> int:
        """The request's own tokens of the transformer's image stream (a packed forward's rows are padded to the
        longest): its latent tokens."""
        return int(state.latents.shape[1])

    def _shift(self, image_seq_len: int, max_shift_default: float = 1.15) -> float:
        """The schedule's `mu`: `calculate_shift` on the image sequence length, as each pipeline's `__call__`
        computes it from its scheduler config (Qwen-Image, Flux and SD3 carry copies of one diffusers function)."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = self.pipe.scheduler.config
        return calculate_shift(image_seq_len, config.get("base_image_seq_len", 256),
                               config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                               config.get("max_shift", max_shift_default))

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

    def _text_key(self, params: SamplingParams) -> tuple:
        """Everything `_encode` reads: the prompt, whether CFG runs and on which negative prompt, the text length,
        images per prompt, the LoRA (its file may carry text-encoder layers)."""
        cfg = self.do_cfg(params)
        return (self.name, params.prompt, cfg, params.negative_prompt if cfg else None, self.text_length(params),
                params.num_images, self.row_lora(params))

    # -- step execution ------------------------------------------------------
    @torch.inference_mode()
    def prepare_encode(self, state: FlowMatchState) -> None:
        """Encode prompts, draw the request's latents, and give it its own scheduler with its timesteps."""
        p = state.params
        with self.loras.rows([self.row_lora(p)]):  # loads it (a bad file fails this request alone); its
            # text-encoder layers, if any, apply to this encode
            state.text = self.text_cache.get_or_encode(self._text_key(p), lambda: self._encode(state))
        if self.pipe.transformer.config.get("guidance_embeds"):  # (SD3's config has no such field)
            state.guidance = to_device([float(p.guidance_scale)], self.device, torch.float32)
        state.generator = torch.Generator(device=self.device).manual_seed(int(p.seed))
        state.latents = self._initial_latents(state)
        if state.scheduler is None:  # (image-to-image sets it first: its latents start at its first timestep)
            self._set_schedule(state)
        assert state.schedule.num_steps == state.num_steps, "the schedule runs the request's total_steps"

    def _set_schedule(self, state: FlowMatchState) -> None:
        """The request's own scheduler and timesteps: the last `state.num_steps` of the schedule (the adapter's
        `total_steps`: with an image, where diffusers' image-to-image `get_timesteps` cuts it)."""
        from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps

        n = state.params.num_inference_steps
        # The copy is request-local: diffusers keeps `_step_index` on the scheduler object.
        # Copying before set_timesteps (rather than after) also leaves pipe.scheduler untouched.
        scheduler = copy.deepcopy(self.pipe.scheduler)
        timesteps, _ = retrieve_timesteps(scheduler, n, self.device, **self._timestep_kwargs(state))
        begin = (n - state.num_steps) * scheduler.order
        scheduler.set_begin_index(begin)  # the step loop starts at the schedule's first timestep
        state.scheduler, state.begin_index = scheduler, begin
        state.sigma_steps = (scheduler.sigmas[1:] - scheduler.sigmas[:-1])[begin:]  # as step() computes each dt
        state.schedule = Schedule([timesteps[begin:]])

    @torch.inference_mode()
    def denoise_step(self, input_batch: InputBatch, *, states: list[FlowMatchState]) -> torch.Tensor:
        """The noise prediction for every row of the batch at each row's own timestep (CFG applied)."""
        assert [s.request_id for s in states] == input_batch.request_ids, "states must match the input batch"
        do_cfg = {self.do_cfg(s.params) for s in states}
        assert len(do_cfg) == 1, "requests with and without CFG never share a batch (see the keys)"
        latents = input_batch["latents"]
        timestep = self._model_timestep(input_batch["timesteps"], latents)
        rows = input_batch.cache.get("rows")
        if rows is None:  # per-row inputs hold while the membership does (RoPE tables of a ragged batch)
            rows = input_batch.cache["rows"] = self._row_inputs(states)
        text = self._text_inputs(input_batch)
        plan = [self.row_lora(s.params) for s in states for _ in range(s.num_rows)]
        with self.loras.rows(plan):
            return self._denoise(latents, timestep, text, rows, states, do_cfg.pop(), plan)

    def _denoise(self, latents: torch.Tensor, timestep: torch.Tensor, text: dict, rows: dict,
                 states: list[FlowMatchState], do_cfg: bool, plan: list) -> torch.Tensor:
        scale = None
        if do_cfg:
            scales = {self.cfg_scale(s.params) for s in states}
            assert len(scales) == 1, "one CFG scale per batch (it is part of the keys)"
            scale = scales.pop()
        cfg_ranks = self.config.parallel.cfg_parallel
        if self.workers is not None and cfg_ranks:  # cond rows on the first group of ranks, uncond rows on the
            # second (each group one rank, or sequence_parallel_size ranks that split the tokens); without CFG the
            # first group alone
            return cfg_parallel.forward(self.workers, latents, timestep, text, rows, scale, RowFacts.of(states),
                                        plan, self.cache_steps)
        if self.workers is not None and not cfg_ranks and self.sequence_parallel_size > 1:  # every rank its tokens
            return sequence_parallel.forward(self.workers, latents, timestep, text, rows, scale, self.cfg_batching,
                                             RowFacts.of(states), plan, self.cache_steps)
        return self._predict(latents, timestep, text, rows, states, scale)

    def _predict(self, latents: torch.Tensor, timestep: torch.Tensor, text: dict, rows: dict,
                 states: list[FlowMatchState], scale: Optional[float]) -> torch.Tensor:
        """The prediction in this process (a sequence-parallel rank runs it too): the cond forward, or with a CFG
        `scale` both forwards (one of 2B rows, or two of B rows) combined."""
        # "branches": the CFG branch of each half of the forward's rows (a step cache keeps one state per branch)
        if scale is None:
            with self._cache_context("cond"):
                return self._transformer(latents, timestep, text["cond"], {**rows, "branches": ("cond",)}, states)
        if self.cfg_batching:
            first, second = self.cfg_order
            with self._cache_context(first):
                both = self._transformer(torch.cat([latents, latents]), torch.cat([timestep, timestep]), text["cfg"],
                                         {**_repeat_rows(rows, self.batch_inputs), "branches": self.cfg_order},
                                         states)
            pred = dict(zip(self.cfg_order, both.chunk(2)))
        else:
            pred = {}
            for side in ("cond", "uncond"):
                with self._cache_context(side):
                    pred[side] = self._transformer(latents, timestep, text[side], {**rows, "branches": (side,)},
                                                   states)
        return self._combine_cfg(pred["cond"], pred["uncond"], scale)

    @torch.inference_mode()
    def step_scheduler(self, state: FlowMatchState, noise_pred: torch.Tensor) -> None:
        """The only place a request's latents change and its step index advances."""
        state.latents = _euler_step(state.scheduler, state, noise_pred)
        state.step_index += 1

    @torch.inference_mode()
    def step_batch(self, input_batch: InputBatch, states: list[FlowMatchState], prediction: torch.Tensor) -> bool:
        """Every row's Euler step at once: `latents + dt * prediction`, each row with its own request's dt,
        the formula `FlowMatchEulerDiscreteScheduler.step` applies per request. The result becomes the
        batch's latents (each request holds its rows as views), so an unchanged batch gathers it again
        without a copy.

        Whether this is bit for bit the per-request step depends on how the device's kernels treat a
        0-dim dt in reduced precision, so the first batch of each dtype and device is compared with the
        per-request step (on scheduler copies); where they differ, requests step one by one from then on.
        """
        if input_batch.seq_lens is not None or not all(_plain_euler(s) for s in states):
            return False
        latents = input_batch["latents"]
        dt = torch.cat([s.sigma_steps[s.step_index:s.step_index + 1].expand(s.num_rows) for s in states])
        dt = dt.to(prediction.dtype).view(-1, *(1,) * (latents.dim() - 1))
        stepped = (latents.to(torch.float32) + dt * prediction).to(prediction.dtype)
        key = (prediction.dtype, prediction.device.type)
        if key not in self._batched_step_exact:
            self._batched_step_exact[key] = all(
                torch.equal(rows, _euler_step(copy.copy(state.scheduler), state, pred)) for state, rows, pred
                in zip(states, input_batch.split(stepped), input_batch.split(prediction)))
            logger.info("%s: batched scheduler steps %s for %s on %s", self.name,
                        "on" if self._batched_step_exact[key] else "off (not bit for bit)", *key)
        if not self._batched_step_exact[key]:
            return False
        for state, rows in zip(states, input_batch.adopt("latents", stepped)):
            state.latents = rows
            state.step_index += 1
            # diffusers' own counter (counted from the schedule's begin), for a later per-request step
            state.scheduler._step_index = state.begin_index + state.step_index
        return True

    @torch.inference_mode()
    def post_decode(self, states: list[FlowMatchState]) -> list[Outputs]:
        """`{"image": float32 [N, H, W, 3] in [0, 1]}` per state, as `pipe(..., output_type="np")` has them,
        left on the device (the runner brings a tick's outputs to the host at once).

        One `vae.decode` call per image size for all the given states.
        """
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, state in enumerate(states):
            by_size.setdefault((state.params.height, state.params.width), []).append(i)
        out: list[Outputs] = [{} for _ in states]
        for (height, width), indices in by_size.items():
            latents = self._unpack(torch.cat([states[i].latents for i in indices]), height, width)
            images = self.pipe.image_processor.postprocess(self._vae_decode(latents), output_type="pt")
            images = images.permute(0, 2, 3, 1).float()  # what output_type="np" does, but the .cpu()
            start = 0
            for i in indices:
                rows = states[i].num_rows
                out[i] = {"image": images[start:start + rows]}
                start += rows
        return out

    @torch.inference_mode()
    def preview(self, state: FlowMatchState) -> Outputs:
        """A fixed linear map of the current latents to RGB, upsampled (nearest) to the image size.

        Reads the state only, so previews never change the final image.
        """
        p = state.params
        latents = self._unpack(state.latents, p.height, p.width)
        weights, bias = self._preview_projection()
        rgb = torch.einsum("nchw,cr->nrhw", latents.float(), weights) + bias.view(1, 3, 1, 1)
        rgb = F.interpolate(rgb, size=(p.height, p.width), mode="nearest")
        return {"image": to_uint8((rgb + 1) / 2).permute(0, 2, 3, 1)}  # on the device: the runner brings it back

    # -- helpers shared by every path ----------------------------------------
    def _cache_context(self, name: str):
        """The transformer's cache context (as the pipelines enter it), where it has one (SD3's has none)."""
        cache_context = getattr(self.pipe.transformer, "cache_context", None)
        return cache_context(name) if cache_context is not None else contextlib.nullcontext()

    def _guidance_rows(self, states: list[FlowMatchState]) -> Optional[torch.Tensor]:
        """Per-row embedded guidance (float32, as the pipelines build it) for guidance-distilled models, else None:
        from each request's device copy (made at admission), so a denoising tick reads nothing from the host."""
        if not self.pipe.transformer.config.guidance_embeds:
            return None
        return torch.cat([s.guidance.expand(s.num_rows) for s in states])

    def _text_inputs(self, input_batch: InputBatch) -> dict[str, TextParts]:
        """Batched text per side ("cond", "uncond", and "cfg" = both in `cfg_order`), cached while
        the batch membership holds."""
        text = input_batch.cache.get("text")
        if text is None:
            sides = input_batch.states[0].text.keys()
            parts = {side: [s.text[side] for s in input_batch.states] for side in sides}
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


def _repeat_rows(rows: dict, shared: tuple[str, ...] = ()) -> dict:
    """Per-row inputs for a batched CFG forward: every row twice, in the same halves as the latents (the inputs
    named in `shared`, the whole batch's, once)."""
    doubled = {}
    for name, value in rows.items():
        if value is None or name in shared:
            doubled[name] = value
        elif isinstance(value, torch.Tensor):
            doubled[name] = torch.cat([value, value])
        elif hasattr(value, "repeated"):  # a structure over the rows (a Packing: mixed sizes)
            doubled[name] = value.repeated(2)
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


def _plain_euler(state: FlowMatchState) -> bool:
    """A deterministic flow-match Euler scheduler (the only kind `step_batch` reproduces)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = state.scheduler
    return (type(scheduler) is FlowMatchEulerDiscreteScheduler and not scheduler.config.stochastic_sampling
            and state.sigma_steps is not None)


def _euler_step(scheduler: Any, state: FlowMatchState, noise_pred: torch.Tensor) -> torch.Tensor:
    """The request's next latents from `scheduler.step` (its own scheduler, or a copy to leave it untouched)."""
    return scheduler.step(noise_pred, state.schedule.timestep(state.step_index), state.latents, return_dict=False)[0]
