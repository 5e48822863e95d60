"""LoRA per request: the files of one folder, loaded into the pipeline on demand, applied per row.

diffusers' `load_lora_weights` injects peft LoRA layers into the transformer, and its
`set_adapters` activates one set of adapters for the whole batch. We load the same way
but keep every adapter disabled in peft's own forward, and add each request's low-rank
delta to its own rows from a forward hook instead:

    output[rows of request r] += lora_B(lora_A(x[rows])) * (scale_r * lora_alpha / r)

which is peft's own expression (its `set_scale` and `Linear.forward`) restricted to those
rows, so requests with different LoRAs, scales or none share one denoise forward. A
group that covers every row uses `x` itself, the same operation as diffusers with
`set_adapters([name], [scale])`, so a solo request matches it bit for bit. The layers a
LoRA has in a text encoder (Flux's and SD3's loaders take them) are hooked the same way
and apply to the prompt of the request that names it, encoded within `rows([lora])`.

Files are `<lora_dir>/<name>.safetensors` in the format `save_lora_weights` writes. A
file dropped in is found on its first use; a changed file (mtime) is reloaded; at most
`max_loras` adapters stay loaded (least recently used unloaded first, never one the
current batch needs).
"""

from __future__ import annotations

import itertools
import re
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch

from engine_lib.host_copy import to_device
from engine_lib.interface import InputSpec
from engine_lib.pipelines import levers
from engine_lib.request import InvalidInputError

LORA_NAME = InputSpec("lora_name", "BYTES", "a LoRA: the stem of a .safetensors file in the model's lora_dir; "
                      "empty (default): none", default="", high=128, batch="adapter")
LORA_SCALE = InputSpec("lora_scale", "FP32", "the LoRA's weight (diffusers' set_adapters weight)", default=1.0,
                       low=-8.0, high=8.0, batch="adapter")
LORA_INPUTS = (LORA_NAME, LORA_SCALE)
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
MAX_LISTED = 20

RowLora = Optional[tuple[str, float]]  # (name, scale) of one row; None: no LoRA


class LoraLibrary:
    """The LoRAs of `folder` for one pipeline (see the module docstring). `check` reads only the
    folder and may run on any thread; `ensure` and `rows` run on the engine thread only."""

    def __init__(self, pipe: Any, folder: Optional[str], max_loras: int = 4):
        self.pipe = pipe
        self.folder = Path(folder) if folder else None
        self.max_loras = max(1, int(max_loras))
        self._loaded: "OrderedDict[str, tuple[str, float]]" = OrderedDict()  # name -> (adapter, mtime), LRU first
        self._ids = itertools.count(1)
        self._hooked: set[int] = set()
        self._plan: Optional[list[RowLora]] = None
        self._token_plan: Optional[list[RowLora]] = None  # within `packed`: each packed token's row's LoRA
        self._token_indices: Optional[dict] = None
        self._indices: dict[tuple, dict] = {}  # (plan, rows, device) -> _row_indices (engine thread)
        self.refusal = ""  # set at load where the model cannot take a LoRA (why), and every lora_name is refused

    # -- names (admission) ---------------------------------------------------------------
    def names(self) -> list[str]:
        if self.folder is None or not self.folder.is_dir():
            return []
        return sorted(p.stem for p in self.folder.glob("*.safetensors") if p.is_file())

    def path(self, name: str) -> Path:
        return self.folder / f"{name}.safetensors"

    def check(self, name: str) -> None:
        """Refuse a name that is not a file stem of the folder, naming `lora_name` and the available ones.
        Messages name files, never the folder: they reach every client, and where it lies on disk is not theirs."""
        if not name:
            return
        if self.refusal:
            raise InvalidInputError("lora_name", self.refusal)
        if not NAME_PATTERN.fullmatch(name) or ".." in name:
            raise InvalidInputError("lora_name", f"{name[:64]!r} is not a LoRA name (a file stem: letters, digits, "
                                                 f"'.', '_', '-'; no path)")
        if self.folder is None or not self.path(name).is_file():
            names = self.names()
            listed = ", ".join(names[:MAX_LISTED]) + (f", ... ({len(names)} in all)" if len(names) > MAX_LISTED else "")
            where = "in the model's lora_dir" if self.folder else "(this model has no lora_dir)"
            raise InvalidInputError("lora_name", f"no LoRA {name!r} {where}; available: {listed or 'none'}")

    # -- loading (engine thread) ---------------------------------------------------------
    def ensure(self, names: Sequence[str]) -> None:
        """Load every named LoRA that is not loaded (or whose file changed), then unload the least
        recently used others past max_loras. A file that cannot be loaded raises InvalidInputError."""
        for name in dict.fromkeys(n for n in names if n):
            path = self.path(name)
            if not path.is_file():
                raise InvalidInputError("lora_name", f"the LoRA file {name}.safetensors is gone")
            mtime = path.stat().st_mtime
            loaded = self._loaded.get(name)
            if loaded is not None and loaded[1] != mtime:
                self._unload(name)
                loaded = None
            if loaded is None:
                self._load(name, mtime)
            self._loaded.move_to_end(name)
        needed = set(names)
        for name in list(self._loaded):
            if len(self._loaded) <= self.max_loras:
                break
            if name not in needed:
                self._unload(name)

    def _load(self, name: str, mtime: float) -> None:
        adapter = f"lora{next(self._ids)}"  # peft names modules by it: a file stem may hold '.'
        try:
            # a quantized (torchao) layer cannot take a LoRA in inference mode
            with torch.inference_mode(False), levers.model_offload_paused(self.pipe):
                self.pipe.load_lora_weights(str(self.path(name)), adapter_name=adapter)
        except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file fails its own request only
            self._forget(adapter)
            reason = str(exc)
            for folder in {str(self.folder), str(self.folder.resolve())}:  # a loader may name the path
                reason = reason.replace(folder, "<lora_dir>")
            raise InvalidInputError("lora_name", f"the LoRA file {name}.safetensors could not be loaded: "
                                                 f"{type(exc).__name__}: {reason[:200]}") from None
        self._disable_peft()  # peft's own forward adds nothing; our hook does
        self._loaded[name] = (adapter, mtime)
        self._hook_new_layers()

    def _unload(self, name: str) -> None:
        adapter, _ = self._loaded.pop(name)
        self._forget(adapter)

    def _forget(self, adapter: str) -> None:
        if any(adapter in (getattr(model, "peft_config", None) or {}) for model in self._models()):
            self.pipe.delete_adapters([adapter])
        self._disable_peft()

    def _models(self) -> list:
        """The transformer and the text encoders a LoRA file may carry layers for."""
        names = ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3")
        return [model for model in (getattr(self.pipe, name, None) for name in names) if model is not None]

    def _disable_peft(self) -> None:
        from diffusers.utils.peft_utils import set_adapter_layers  # noqa: PLC0415 (what `disable_lora` runs)

        for model in self._models():
            if getattr(model, "peft_config", None):
                set_adapter_layers(model, enabled=False)

    def _hook_new_layers(self) -> None:
        from peft.tuners.lora import LoraLayer  # noqa: PLC0415 (only models with LoRAs import peft)

        for model in self._models():
            for module in model.modules():
                if isinstance(module, LoraLayer) and id(module) not in self._hooked:
                    # eager inside a compiled block: dynamo would guard on the plan, which changes every tick
                    module.register_forward_hook(torch.compiler.disable(self._add_deltas))
                    self._hooked.add(id(module))

    @property
    def loaded(self) -> list[str]:
        return list(self._loaded)

    # -- applying (engine thread) -----------------------------------------------------------
    @contextmanager
    def rows(self, plan: Sequence[RowLora]) -> Iterator[None]:
        """Within: each transformer (or text encoder) forward adds row i's LoRA (plan[i]) to row i. Forwards of a
        multiple of len(plan) rows (CFG as one forward) repeat the plan per block of rows."""
        if not any(plan):
            yield
            return
        self.ensure([p[0] for p in plan if p])
        self._plan = list(plan)
        try:
            yield
        finally:
            self._plan = None

    @contextmanager
    def packed(self, token_rows: Sequence[int]) -> Iterator[None]:
        """Within `rows`, around a forward whose image stream packs the rows' tokens into one sequence
        [1, T, ...] (Qwen-Image's mixed sizes): a layer that sees that sequence adds each token its own
        row's LoRA (`token_rows[t]` is token t's row; a multiple of the plan's rows repeats the plan)."""
        plan = self._plan
        if plan is None:
            yield
            return
        self._token_plan, self._token_indices = [plan[row % len(plan)] for row in token_rows], None
        try:
            yield
        finally:
            self._token_plan = self._token_indices = None

    @contextmanager
    def only(self, rows: Sequence[int]) -> Iterator[None]:
        """Within `rows`, around a forward of some of the rows alone, in this order (SD3's patch embedding
        runs once per image size): a layer that sees them adds each its own row's LoRA."""
        saved = self._plan, self._token_plan, self._token_indices
        if saved[0] is None:
            yield
            return
        self._plan, self._token_plan = [saved[0][row % len(saved[0])] for row in rows], None
        try:
            yield
        finally:
            self._plan, self._token_plan, self._token_indices = saved

    def _add_deltas(self, module: Any, args: tuple, output: torch.Tensor) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            return output
        x = args[0]
        # the packed stream [1, T, ...]: a row per token. (With one row, the row path below adds the same, and a
        # one-row text stream [1, L, ...] looks like it: the rows of a TaylorSeer forward that compute alone.)
        if self._token_plan is not None and x.dim() == 3 and x.shape[0] == 1 and len(plan) > 1:
            if x.shape[1] != len(self._token_plan):
                raise RuntimeError(f"a LoRA layer saw {x.shape[1]} packed tokens for a plan of {len(self._token_plan)}")
            if self._token_indices is None:
                self._token_indices = self._row_indices(self._token_plan, x.shape[1], x.device)
            return self._add(module, x[0], output[0], self._token_indices).unsqueeze(0)
        rows = x.shape[0]
        if rows % len(plan):
            raise RuntimeError(f"a LoRA layer saw {rows} rows for a plan of {len(plan)}")
        return self._add(module, x, output, self._row_indices(plan, rows, x.device))

    def _add(self, module: Any, x: torch.Tensor, output: torch.Tensor, indices: dict) -> torch.Tensor:
        """`output` plus each LoRA's delta on its rows of `x` (`indices`: LoRA -> rows, None: every row)."""
        for (name, scale), index in indices.items():
            adapter = self._loaded[name][0]
            if adapter not in module.lora_A:
                continue  # this LoRA leaves this layer alone
            lora_a, lora_b = module.lora_A[adapter], module.lora_B[adapter]
            if module.use_rslora.get(adapter, False):
                scaling = scale * module.lora_alpha[adapter] / module.r[adapter] ** 0.5
            else:
                scaling = scale * module.lora_alpha[adapter] / module.r[adapter]  # peft's set_scale
            dropout = module.lora_dropout[adapter]
            if index is None:  # every row: exactly peft's forward
                output = output + lora_b(lora_a(dropout(x.to(lora_a.weight.dtype)))) * scaling
            else:
                delta = lora_b(lora_a(dropout(x.index_select(0, index).to(lora_a.weight.dtype)))) * scaling
                output = output.index_add(0, index, delta.to(output.dtype))
        return output

    def _row_indices(self, plan: list[RowLora], rows: int, device: torch.device) -> dict:
        """Each LoRA of the plan -> the rows it applies to (a device index tensor; None: every row). Made once
        per plan and row count, not in every layer of every forward: each would be a host-to-device copy,
        which waits on CUDA without `to_device`'s pinned staging."""
        key = (tuple(plan), rows, device)
        indices = self._indices.get(key)
        if indices is None:
            groups: dict[tuple[str, float], list[int]] = {}
            for row, lora in enumerate(plan * (rows // len(plan))):
                if lora is not None:
                    groups.setdefault(lora, []).append(row)
            indices = {lora: None if len(group) == rows else to_device(group, device)
                       for lora, group in groups.items()}
            if len(self._indices) >= 16:  # plans change with membership; keep the recent ones
                self._indices.clear()
            self._indices[key] = indices
        return indices
