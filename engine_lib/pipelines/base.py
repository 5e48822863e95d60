"""The contract between the engine's runner and a pipeline adapter.

An adapter wraps one pipeline (a diffusers pipeline loaded with `from_pretrained`,
or our own model code) and declares its interface:

* `inputs` (InputSpec) and `outputs` (OutputSpec): the Triton config, the one
  validation of a request, the batching keys and the response tensors all follow
  from them (engine_lib/interface.py);
* `capabilities` (capabilities.py): the features it runs (request_batch,
  step_execution, mixed_sizes, previews, lora, each cache kind, image inputs,
  think/text, each kind of parallelism), the most requests a step batch advances,
  and the pairs of its features that do not combine, with the reason. One check
  (`capabilities.check`) refuses at load and at admission what it does not run;
  `batched_decode` (whether `post_decode` decodes several states in one call, so
  waiting to decode together pays);
* `state_class`: its typed per-request state (a `RequestState` subclass).

and implements the step contract, which is the only way the runner runs it
(request mode and step mode share one loop, engine_lib/runner.py):

* `prepare_encode(state)` once per request: encode, draw latents, build its schedule;
* `denoise_step(input_batch, states=...)` once per tick over all scheduled rows;
* `step_scheduler(state, noise_pred)` per request per tick: the only place
  latents change and `step_index` advances (`step_batch` may do all of a tick's
  requests in one operation instead, where that is bit for bit the same);
* `post_decode(states)` once for the requests that finished in the same tick:
  one dict of named float outputs per state (`output_type="np"` values, as numpy
  arrays or as tensors left on the device; the runner converts them to the
  declared dtypes and brings a tick's tensors to the host at once, host_copy.py);
* `preview(state)`: optional cheap named uint8 outputs of the current latents;
* `chunk_outputs(state)`: after each scheduler step, a pipeline that decodes as
  it goes (Helios, chunk by chunk) hands back what it just decoded, streamed at
  once as an intermediate response (None: nothing new).

Request-local state (latents, scheduler copies, generator, step index) lives in
the state object the runner owns, never on the adapter.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

import torch
import torch.nn.functional as F

from engine_lib.config import ConfigError, EngineConfig
from engine_lib.interface import InputSchema, InputSpec, OutputSpec
from engine_lib.pipelines.capabilities import Capabilities, check, make
from engine_lib.pipelines.loading import load_diffusers
from engine_lib.request import SamplingParams
from engine_lib.sched.keys import RequestBatchKey, StepBatchKey, request_batch_key, step_batch_key
from engine_lib.sched.outputs import Outputs

Prediction = Union[torch.Tensor, dict]  # one tensor per row, or several by name (video + audio)
# max_request_cost=auto admits a request of up to this many times its pipeline's `cost_reference` (latent tokens
# x rows): every request the default limits allow for images (4 images with CFG at the default size), about 4x
# a default video forward (LTX-2's 1024x1024x257 frames is 5.5x: refused).
REQUEST_COST_FACTOR = 4


@dataclass
class Schedule:
    """A request's denoise steps, in phases that each run their own timesteps.

    Image pipelines have one phase; a chunked video pipeline (Helios) has one per
    chunk and sets each phase's timesteps when it starts. `step_index` counts
    steps over all phases.
    """

    phases: list[torch.Tensor] = field(default_factory=list)  # timesteps of each phase

    @property
    def num_steps(self) -> int:
        return sum(len(t) for t in self.phases)

    def locate(self, step_index: int) -> tuple[int, int]:
        """(phase, index within that phase) of a global step index."""
        for phase, timesteps in enumerate(self.phases):
            if step_index < len(timesteps):
                return phase, step_index
            step_index -= len(timesteps)
        raise IndexError(f"step {step_index} is past the schedule's {self.num_steps} steps")

    def timestep(self, step_index: int) -> torch.Tensor:
        phase, index = self.locate(step_index)
        return self.phases[phase][index]


@dataclass
class RequestState:
    """What every request carries between denoise steps (owned by the runner).

    An adapter subclasses it with its own typed fields (latents, scheduler copies,
    text embeddings, ...) and names the subclass in `state_class`.
    """

    request_id: str
    params: SamplingParams
    step_index: int = 0
    num_steps: int = 0

    @property
    def denoise_completed(self) -> bool:
        return self.step_index >= self.num_steps

    @property
    def num_rows(self) -> int:
        """Rows this request adds to a batched forward."""
        raise NotImplementedError

    def step_inputs(self) -> dict[str, torch.Tensor]:
        """This request's per-row tensors for the next forward (rows first), gathered by `InputBatch`."""
        raise NotImplementedError


def move_tensors(obj: Any, device: torch.device) -> Any:
    """Move every tensor a state holds (its fields, nested dataclasses, dicts, lists) to `device`, in place.
    Other objects (generators, diffusers scheduler copies) stay as they are. Returns `obj` (or its copy,
    for tensors and tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            setattr(obj, f.name, move_tensors(getattr(obj, f.name), device))
    elif isinstance(obj, dict):
        for key in obj:
            obj[key] = move_tensors(obj[key], device)
    elif isinstance(obj, list):
        obj[:] = [move_tensors(item, device) for item in obj]
    elif isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(move_tensors(item, device) for item in obj)
    return obj


@dataclass
class InputBatch:
    """The rows of one batched denoise forward: gathered in one place, split back in one place.

    `tensors` holds every state's `step_inputs()` concatenated by name. Token
    sequences of different lengths (images of different sizes, for an adapter
    whose step key leaves the size out) are right-padded with zeros to the
    longest; `seq_lens` then holds each request's own length, and `split` cuts
    the padding off again. `cache` survives while the batch's membership is
    unchanged, so an adapter can keep batched prompt embeddings there instead of
    rebuilding them every tick. So does a tensor the adapter `adopt`ed (the
    latents a batched scheduler step wrote): while every request still hands
    back the very rows it was given, the next gather reuses it without a copy.
    """

    request_ids: list[str]
    states: list[RequestState]
    tensors: dict[str, torch.Tensor]
    row_slices: list[slice]
    cache: dict = field(default_factory=dict)
    seq_lens: Optional[list[int]] = None  # per request, when its tokens were padded to the longest
    pieces: dict = field(default_factory=dict)  # name -> each request's rows (views) of an adopted tensor

    @classmethod
    def gather(cls, states: list[RequestState], previous: Optional["InputBatch"] = None) -> "InputBatch":
        ids = [s.request_id for s in states]
        slices, start = [], 0
        for s in states:
            slices.append(slice(start, start + s.num_rows))
            start += s.num_rows
        parts = [s.step_inputs() for s in states]
        same = previous is not None and previous.request_ids == ids
        tensors, seq_lens, pieces = {}, None, {}
        for name in parts[0]:
            values = [p[name] for p in parts]
            kept = previous.pieces.get(name) if same else None
            if kept is not None and all(v is k for v, k in zip(values, kept)):
                tensors[name], pieces[name] = previous.tensors[name], kept
                continue
            lengths = [v.shape[1] if v.dim() > 1 else 0 for v in values]
            if len(set(lengths)) > 1:
                seq_lens, longest = lengths, max(lengths)
                values = [F.pad(v, (0, 0) * (v.dim() - 2) + (0, longest - v.shape[1])) for v in values]
            tensors[name] = values[0] if len(values) == 1 else torch.cat(values)
        return cls(ids, states, tensors, slices, previous.cache if same else {}, seq_lens, pieces)

    def adopt(self, name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Make `tensor` (every row, unpadded) this batch's `name`; return each request's rows of it (views)."""
        assert self.seq_lens is None, "a padded batch cannot adopt unpadded rows"
        self.tensors[name] = tensor
        self.pieces[name] = [tensor[rows] for rows in self.row_slices]
        return self.pieces[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def split(self, rows: Prediction) -> list[Prediction]:
        """Slice per-row predictions (a tensor, or a dict of them) back into one piece per request,
        without the padding of a ragged batch."""
        def piece(value: torch.Tensor, i: int) -> torch.Tensor:
            value = value[self.row_slices[i]]
            return value[:, :self.seq_lens[i]] if self.seq_lens is not None and value.dim() > 1 else value

        if isinstance(rows, dict):
            return [{name: piece(value, i) for name, value in rows.items()} for i in range(len(self.row_slices))]
        return [piece(rows, i) for i in range(len(self.row_slices))]


class PipelineAdapter(ABC):
    """One pipeline behind the engine's contract; see the module docstring."""

    name: ClassVar[str]
    inputs: ClassVar[tuple[InputSpec, ...]]
    outputs: ClassVar[tuple[OutputSpec, ...]]
    state_class: ClassVar[type[RequestState]] = RequestState
    # What it runs and what does not combine, e.g. `capabilities.make("step_execution", "lora", "first_block")
    # .refuse("tensor_parallel", "first_block", "why")` (capabilities.py; the docs table is generated from it).
    capabilities: ClassVar[Capabilities] = make("step_execution")
    batched_decode: ClassVar[bool] = True  # post_decode decodes its states in one call (decode groups pay)
    # The request `max_request_cost=auto` scales: the pipeline's diffusers default size (and frames), with
    # classifier-free guidance on (the most rows one image or video takes).
    cost_reference: ClassVar[dict] = {}
    workers: Any = None  # the parallel ranks (engine_lib/parallel.py WorkerGroup), from start_workers

    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, config: Optional[EngineConfig] = None):
        self.pipe = pipe
        self.device = device
        self.dtype = dtype
        self.config = config or EngineConfig()  # the parameters it reads: model, cache, lora, parallel, levers

    def close(self) -> None:
        """Stop what the adapter started besides its own process (the parallel workers)."""
        if self.workers is not None:
            self.workers.close()

    def start_workers(self, model_path: str) -> Any:
        """The worker group for `self.config.parallel` (config parameters `cfg_parallel`,
        `sequence_parallel_size`, `tensor_parallel_size`, `expert_parallel`, `devices`), on the ranks'
        devices; the registry calls it once after `load`. A pipeline with parallel support overrides it."""
        raise ConfigError(f"pipeline '{self.name}' runs in one process")

    def launch_workers(self, model_path: str) -> None:
        """`workers = start_workers(...)`, keeping its argument for `restart_workers` (the registry's load)."""
        self._model_path = model_path
        self.workers = self.start_workers(model_path)

    def restart_workers(self) -> None:
        """A new worker group in place of a broken one: the engine calls it after a tick broke the group. Raises
        what `start_workers` raises (the engine tries again later)."""
        self.workers.close()
        self.workers = self.start_workers(self._model_path)

    @classmethod
    @abstractmethod
    def load(cls, model_path: str, device: torch.device, dtype: torch.dtype,
             config: Optional[EngineConfig] = None) -> "PipelineAdapter":
        """Load the pipeline once (`from_pretrained`) and wrap it."""

    # -- the declaration, refined by the loaded checkpoint ----------------------------
    @classmethod
    def example_inputs(cls) -> dict:
        """Small inputs a request needs besides its prompt (an image, where one is required): the warm-up
        request sends them, and so do the tests that run every pipeline."""
        return {}

    @classmethod
    def input_spec(cls, name: str) -> InputSpec:
        """One declared input (as declared, before the checkpoint refines it)."""
        for spec in cls.inputs:
            if spec.name == name:
                return spec
        raise KeyError(f"{cls.name} declares no input {name!r}")

    def input_specs(self) -> tuple[InputSpec, ...]:
        """The declared inputs with what only the loaded checkpoint knows (size multiples, limits)."""
        return self.inputs

    def input_schema(self, config: Any) -> InputSchema:
        """The one validation of this adapter's requests under `config` (an EngineConfig): the declared inputs,
        what combines with the config's settings (capabilities.py), then the adapter's own rules."""
        def checks(params: SamplingParams) -> None:
            check(self.name, self.capabilities, config, params)
            self.check_inputs(params)

        return InputSchema(self.name, self.input_specs(), config, check=checks)

    def check_inputs(self, params: SamplingParams) -> None:
        """Rules across inputs or from the checkpoint; raise InvalidInputError naming the input."""

    def pipe_kwargs(self, params: SamplingParams) -> dict:
        """The `pipe(...)` arguments these params stand for: each declared `pipe_arg` that is set, and the
        seed as a generator on this device, as `prepare_encode` seeds it (how outputs are checked against
        the pipeline's own; see OutputSpec.pipe_output)."""
        kwargs = {s.pipe_arg: params[s.name] for s in self.input_specs() if s.pipe_arg and params[s.name] is not None}
        return {**kwargs, "generator": torch.Generator(device=self.device).manual_seed(int(params.seed))}

    @classmethod
    def key_inputs(cls) -> tuple[str, ...]:
        """The inputs that enter the compatibility keys by value (`batch="key"`)."""
        return tuple(spec.name for spec in cls.inputs if spec.batch == "key")

    def key_fields(self, params: SamplingParams) -> tuple:
        """Derived (name, value) pairs the batched tensors depend on (inputs declared `batch="adapter"`)."""
        return ()

    def step_key(self, params: SamplingParams) -> StepBatchKey:
        return step_batch_key(params, self.key_inputs(), self.key_fields(params))

    def total_steps(self, params: SamplingParams) -> int:
        """Denoise steps (ticks) this request runs: `num_inference_steps`, times the chunks of a chunked video.
        The engine sets a request's `num_steps` from it; its step state takes the request's."""
        return int(params.num_inference_steps)

    def new_state(self, request_id: str, params: SamplingParams) -> RequestState:
        """A fresh step state for a request that is not in an engine (tests, offline callers)."""
        return self.state_class(request_id, params, num_steps=self.total_steps(params))

    def request_cost(self, params: SamplingParams) -> int:
        """Latent tokens x rows this request adds to one forward (`max_batch_tokens`); 0: unknown."""
        return 0

    def default_max_request_cost(self) -> int:
        """`max_request_cost=auto`: REQUEST_COST_FACTOR times the cost of `cost_reference` (0: no limit, for an
        adapter that declares none). A request past it would hold the model for one very long forward."""
        if not self.cost_reference:
            return 0
        defaults = {spec.name: spec.default for spec in self.inputs}
        return REQUEST_COST_FACTOR * self.request_cost(SamplingParams(defaults, **self.cost_reference))

    def request_key(self, params: SamplingParams) -> RequestBatchKey:
        return request_batch_key(params, self.key_inputs(), self.key_fields(params))

    # -- the step contract ---------------------------------------------------------------
    @abstractmethod
    def prepare_encode(self, state: RequestState) -> None:
        """Once per request: encode, draw its latents, build its schedule and scheduler copies."""

    @abstractmethod
    def denoise_step(self, input_batch: InputBatch, *, states: list[RequestState]) -> Prediction:
        """One forward over every row of the batch, each at its own step (mutates nothing)."""

    @abstractmethod
    def step_scheduler(self, state: RequestState, noise_pred: Prediction) -> None:
        """The only place a request's latents change and its step index advances."""

    def step_batch(self, input_batch: InputBatch, states: list[RequestState], prediction: Prediction) -> bool:
        """Optional: every request's scheduler step in one batched operation, bit for bit what
        `step_scheduler` would do for each. False: not possible here (the runner steps each request);
        it must then have changed nothing."""
        return False

    @abstractmethod
    def post_decode(self, states: list[RequestState]) -> list[Outputs]:
        """Decode finished requests in one batched call: named float outputs per state."""

    def preview(self, state: RequestState) -> Outputs:
        """Cheap named uint8 outputs of the current latents (reads the state only)."""
        raise NotImplementedError(f"{self.name} has no previews")

    def chunk_outputs(self, state: RequestState) -> Optional[Outputs]:
        """Named float outputs decoded since the last call (a finished video chunk), or None."""
        return None

    def release(self, state: RequestState) -> None:
        """The runner dropped the request's state (finished, failed, aborted or cancelled): free what it held
        outside the state (a parallel pipeline's per-request state on its ranks)."""

    def counters(self) -> dict[str, float]:
        """Monotone totals the adapter keeps (e.g. prompt cache hits), for the metrics."""
        return {}

    def torch_modules(self) -> list[torch.nn.Module]:
        """The pipeline's torch modules (transformer, VAE, text encoders): the runner lets a cancel stop a
        long tick between their blocks. A diffusers pipeline's `components`, else the pipe's attributes."""
        if isinstance(self.pipe, torch.nn.Module):
            return [self.pipe]
        parts = getattr(self.pipe, "components", None) or getattr(self.pipe, "__dict__", {})
        return [part for part in parts.values() if isinstance(part, torch.nn.Module)]


class DiffusersAdapter(PipelineAdapter):
    """An adapter of one diffusers pipeline class (`pipeline_class`), loaded with its own `from_pretrained`,
    with a prompt-embedding cache (`text_cache`, `prompt_cache_mb` of its config) whose hits and misses it counts."""

    pipeline_class: ClassVar[str]  # the diffusers class, e.g. "FluxPipeline"
    levers: Any = None  # what the GPU levers did at load (levers.Applied), set by `load`

    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, config: Optional[EngineConfig] = None):
        from engine_lib.pipelines.text_cache import TextEmbeddingCache

        super().__init__(pipe, device, dtype, config)
        self.text_cache = TextEmbeddingCache(self.config.cache.prompt_cache_mb << 20)

    def counters(self) -> dict[str, float]:
        return {"prompt_cache_hits": self.text_cache.hits, "prompt_cache_misses": self.text_cache.misses,
                **(self.levers.counters() if self.levers else {})}

    def encode_sides(self, params: SamplingParams, cfg: bool) -> dict:
        """{"cond": {"embeds": [1, L, D]}, and "uncond" with `cfg`}: the pipeline's `encode_prompt` where it returns
        both embeddings (the UMT5 of Wan and Helios; with CFG the negative prompt, "" when none), in the
        transformer's dtype as their `__call__` casts them."""
        dtype = self.pipe.transformer.dtype
        cond, uncond = self.pipe.encode_prompt(prompt=params.prompt, negative_prompt=params.negative_prompt,
                                               do_classifier_free_guidance=cfg, num_videos_per_prompt=1,
                                               max_sequence_length=params.max_sequence_length, device=self.device)
        return {"cond": {"embeds": cond.to(dtype)}, **({"uncond": {"embeds": uncond.to(dtype)}} if cfg else {})}

    @classmethod
    def from_pretrained_kwargs(cls, model_path: str) -> dict:
        """Components `from_pretrained` cannot load here, built by the adapter (none by default)."""
        return {}

    @classmethod
    def load(cls, model_path: str, device: torch.device, dtype: torch.dtype,
             config: Optional[EngineConfig] = None) -> "DiffusersAdapter":
        return load_diffusers(cls, model_path, device, dtype, config)
