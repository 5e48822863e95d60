"""The contract between the engine's runner and a pipeline adapter.

An adapter wraps one diffusers pipeline (loaded with `from_pretrained`) and
exposes two ways to run it, each behind a capability flag:

* request batch (`supports_request_batch`): `forward(batch)` runs whole requests,
  one uint8 image array per request, in order.
* step execution (`supports_step_execution`), the seed's four operations:
  `prepare_encode(state)` once per request, `denoise_step(input_batch, states=...)`
  once per tick over all scheduled requests, `step_scheduler(state, noise_pred)`
  per request per tick (the only place latents change and `step_index` advances),
  `post_decode(states)` once for the requests that finished in the same tick.

Request-local state (latents, scheduler copy, generator, step index) lives in
`StepRequestState`, owned by the runner, never on the adapter.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import numpy as np
import torch

from engine_lib.request import DiffusionRequest, InvalidInputError, SamplingParams


@dataclass
class StepRequestState:
    """Everything one request carries between denoise steps (owned by the runner)."""

    request_id: str
    params: SamplingParams
    generator: Optional[torch.Generator] = None
    scheduler: Any = None  # request-local copy of the diffusers scheduler
    latents: Optional[torch.Tensor] = None  # rows = num_images
    timesteps: Optional[torch.Tensor] = None
    step_index: int = 0
    num_steps: int = 0
    extra: dict = field(default_factory=dict)  # adapter-specific tensors (prompt embeds, masks, ...)

    @property
    def denoise_completed(self) -> bool:
        return self.step_index >= self.num_steps

    @property
    def num_rows(self) -> int:
        return 0 if self.latents is None else int(self.latents.shape[0])


@dataclass
class InputBatch:
    """The rows of one batched denoise forward: gathered in one place, split back in one place.

    `cache` survives while the batch's membership is unchanged, so an adapter can
    keep padded prompt embeddings there instead of rebuilding them every tick.
    """

    request_ids: list[str]
    states: list[StepRequestState]
    latents: torch.Tensor
    timesteps: torch.Tensor  # one per row
    row_slices: list[slice]
    cache: dict = field(default_factory=dict)

    @classmethod
    def gather(cls, states: list[StepRequestState], previous: Optional["InputBatch"] = None) -> "InputBatch":
        ids = [s.request_id for s in states]
        slices, start = [], 0
        for s in states:
            slices.append(slice(start, start + s.num_rows))
            start += s.num_rows
        latents = torch.cat([s.latents for s in states], dim=0)
        timesteps = torch.cat([s.timesteps[s.step_index].reshape(1).expand(s.num_rows) for s in states])
        cache = previous.cache if previous is not None and previous.request_ids == ids else {}
        return cls(ids, states, latents, timesteps, slices, cache)

    def split(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Slice a per-row tensor (e.g. the noise prediction) back into one piece per request."""
        return [rows[s] for s in self.row_slices]


@dataclass
class DiffusionRequestBatch:
    """The pipeline-facing static batch of request mode: compatible requests, in order."""

    requests: list[DiffusionRequest]

    @property
    def params(self) -> list[SamplingParams]:
        return [r.params for r in self.requests]

    def __len__(self) -> int:
        return len(self.requests)


# The optional request inputs every image adapter uses (Triton input names = SamplingParams fields).
COMMON_INPUTS = frozenset({"height", "width", "num_inference_steps", "seed", "num_images", "output_format"})
# Every optional SamplingParams field and its default: a field at its default counts as not sent.
OPTIONAL_INPUT_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams) if f.name != "prompt"}


class PipelineAdapter(ABC):
    """One diffusers pipeline behind the engine's contracts.

    Capability flags (class attributes, read by the engine, the serving layer and
    the capability table in docs/pipelines.md):

    * `supports_request_batch`, `supports_step_execution`, `supports_previews`;
    * `supported_inputs`: the optional inputs (Triton input names, which are
      SamplingParams field names; `prompt` is always required) this pipeline
      uses. `validate` rejects any other one that is not at its default, and the
      serving layer can reject an unused input that was sent at all;
    * `cfg_kind`: "" (none), "cfg" (`guidance_scale` > 1 runs an unconditional
      pass, as SD3) or "true_cfg" (`negative_prompt` + `true_cfg_scale` > 1, as
      Qwen-Image and Flux);
    * `per_row_guidance`: rows of one forward may carry different
      `guidance_scale` values (embedded guidance, as Flux).
    """

    name: ClassVar[str]
    supports_request_batch: ClassVar[bool] = False
    supports_step_execution: ClassVar[bool] = False
    supports_previews: ClassVar[bool] = False
    supported_inputs: ClassVar[frozenset[str]] = COMMON_INPUTS
    # What the diffusers pipeline's __call__ uses for an input a request leaves out
    # (applied at the Triton edge, so equal requests get equal compatibility keys).
    default_inputs: ClassVar[dict] = {}
    cfg_kind: ClassVar[str] = ""
    per_row_guidance: ClassVar[bool] = False

    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, options: Optional[dict] = None):
        self.pipe = pipe
        self.device = device
        self.dtype = dtype
        self.options = dict(options or {})

    # -- loading and limits --------------------------------------------------
    @classmethod
    @abstractmethod
    def load(cls, model_path: str, device: torch.device, dtype: torch.dtype,
             options: Optional[dict] = None) -> "PipelineAdapter":
        """Load the diffusers pipeline once (`from_pretrained`) and wrap it."""

    @property
    @abstractmethod
    def size_multiple(self) -> int:
        """Height and width must be multiples of this."""

    def validate(self, params: SamplingParams) -> None:
        """Pipeline-specific input checks; raise InvalidInputError naming the input."""
        for name, default in OPTIONAL_INPUT_DEFAULTS.items():
            value = getattr(params, name)
            if name not in self.supported_inputs and value != default:
                raise InvalidInputError(
                    name, f"{value!r}: {self.name} does not use this input (it uses: "
                          f"{', '.join(sorted(self.supported_inputs))})")
        m = self.size_multiple
        for name in ("height", "width"):
            value = getattr(params, name)
            if value < m or value % m:
                raise InvalidInputError(name, f"{value} must be a positive multiple of {m}")

    def key_fields(self, params: SamplingParams) -> tuple:
        """Extra fields this pipeline's batched tensor contract depends on (joined into the keys)."""
        return ()

    # -- request batch -------------------------------------------------------
    def forward(self, batch: DiffusionRequestBatch) -> list[np.ndarray]:
        raise NotImplementedError(f"{self.name} does not support request batching")

    # -- step execution ------------------------------------------------------
    def prepare_encode(self, state: StepRequestState) -> None:
        raise NotImplementedError(f"{self.name} does not support step execution")

    def denoise_step(self, input_batch: InputBatch, *, states: list[StepRequestState]) -> torch.Tensor:
        raise NotImplementedError

    def step_scheduler(self, state: StepRequestState, noise_pred: torch.Tensor) -> None:
        raise NotImplementedError

    def post_decode(self, states: list[StepRequestState]) -> list[np.ndarray]:
        """Decode finished requests in one batched call; one uint8 [N, H, W, 3] array per state."""
        raise NotImplementedError

    def preview(self, state: StepRequestState) -> np.ndarray:
        """A cheap uint8 [N, H, W, 3] preview of the current latents."""
        raise NotImplementedError
