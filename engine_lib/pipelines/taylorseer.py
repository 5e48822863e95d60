"""TaylorSeer per request inside a shared step batch (diffusers' `apply_taylorseer_cache`, decided per row group).

diffusers' hook (diffusers/hooks/taylorseer_cache.py) wraps every attention module (`^transformer_blocks.*attn`,
`^single_transformer_blocks.*attn`) and counts, per module and cache context, the calls it sees: a call before
`disable_cache_before_step` or every `cache_interval`-th after it computes (the module runs and its Taylor
factors are renewed: the output and its divided differences up to `max_order`, stored in `taylor_factors_dtype`);
any other call predicts the output from the factors by a Taylor expansion in the steps since the last compute,
and the module does not run. A pipeline calls the transformer once per step and cache context ("cond",
"uncond"), so the count is the step index; SD3's pipeline runs CFG as one call of both halves, whose factors
are elementwise the two halves' own.

Here the same math runs per row group: one request x one CFG branch, deciding from the request's own step
index, so requests at different steps, with the cache off or with the first-block cache, share a forward. While
a forward runs, `Plan.attending` puts a wrapper on each attention module that runs it over the rows that compute
(taken by index), renews their factors and puts the predicted rows in place. The factors are the request's
(`FlowMatchState.step_cache`: per CFG branch, one `ModuleFactors` per attention module), moved with the state
when it pauses and freed with it. diffusers' defaults are kept (cache_interval 5, disable_cache_before_step 3,
max_order 1, bfloat16 factors): with them steps 0-2 and then 4, 9, 14, ... compute.

The packed forwards of mixed-size batches (packing.py) call the attention's parts themselves, not the module:
they run it through `packed_attention`, which under a plan does what `_attend` does over packed rows: the rows
that compute attend packed on their own (`packing.subset`), and each group's factors hold its outputs in the
module's own layout (its image tokens unpadded, its text rows; Flux's single-stream blocks [text; image] joined),
so a request's factors carry over between packed and one-size forwards.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from diffusers.hooks import TaylorSeerCacheConfig
from diffusers.hooks.taylorseer_cache import _TRANSFORMER_BLOCK_IDENTIFIERS

from engine_lib.host_copy import to_device

CONFIG = TaylorSeerCacheConfig()  # diffusers' defaults
PER_ROW = ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "attention_mask")


def caches(params) -> bool:
    """Whether the request asked for TaylorSeer (or the deployment's default_cache did)."""
    return params.get("cache") == "taylorseer"


def computes(step: int) -> bool:
    """diffusers' `TaylorSeerCacheHook._measure_should_compute` at the call `step` (0 first)."""
    before = CONFIG.disable_cache_before_step
    return step < before or (step - before - 1) % CONFIG.cache_interval == 0


@dataclass
class ModuleFactors:
    """One attention module of one request's CFG branch, as diffusers' `TaylorSeerState` holds it."""

    last_step: Optional[int] = None  # the step that last computed
    factors: list = field(default_factory=list)  # per output: its Taylor factors, order 0 first
    dtypes: tuple = ()  # the module's output dtypes

    def update(self, outputs: list[torch.Tensor], step: int) -> None:
        """`TaylorSeerState.update`: the outputs and their divided differences against the last factors. The same
        step again (a batched forward that failed part way, run again one request at a time: runner.py) renews
        the outputs and keeps the differences, which were taken at this step."""
        self.dtypes = tuple(o.dtype for o in outputs)
        if step == self.last_step:
            self.factors = [[o.to(CONFIG.taylor_factors_dtype, copy=True), *(fit(f, o.shape[1]) for f in old[1:])]
                            for o, old in zip(outputs, self.factors)]
            return
        renewed = []
        for i, features in enumerate(outputs):
            orders = [features]
            if self.last_step is not None:
                delta = step - self.last_step
                previous = self.factors[i]
                for j in range(min(CONFIG.max_order, len(previous))):  # (over the tokens both text lengths share)
                    orders.append((orders[j] - fit(previous[j], orders[j].shape[1]).to(features.dtype)) / delta)
            # copies: a row group's factors hold none of the batch's other rows
            renewed.append([f.to(CONFIG.taylor_factors_dtype, copy=True) for f in orders])
        self.factors, self.last_step = renewed, step

    def predict(self, step: int) -> list[torch.Tensor]:
        """`TaylorSeerState.predict`: the outputs at `step`, operation for operation."""
        offset = step - self.last_step
        outputs = []
        for dtype, orders in zip(self.dtypes, self.factors):
            out = torch.zeros_like(orders[0], dtype=dtype)
            for order in range(len(orders)):
                out = out + orders[order].to(dtype) * ((offset ** order) / math.factorial(order))
            outputs.append(out)
        return outputs


def fit(tensor: torch.Tensor, tokens: int) -> torch.Tensor:
    """`tensor` [rows, tokens', ...] cut or zero-padded to `tokens` along its token axis. A text stream is padded to
    the longest prompt of the forward's batch, which changes as requests join and leave it; a request's own tokens
    come first and are fewer than any batch's padding, so they keep their values, and its padding stays padding."""
    if tensor.shape[1] >= tokens:
        return tensor[:, :tokens]
    return F.pad(tensor, (0, 0) * (tensor.dim() - 2) + (0, tokens - tensor.shape[1]))


@dataclass
class Group:
    """Rows [rows] of a forward: one request's rows of one CFG branch."""

    rows: slice
    step: int = 0  # the request's step index
    factors: Optional[list[ModuleFactors]] = None  # None: this request does not use TaylorSeer (it computes)

    @property
    def computes(self) -> bool:
        return self.factors is None or computes(self.step)


_MODULES: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()
_RUNNING: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()  # module: (plan, k)


def attention_modules(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules diffusers' hook wraps by default, in `named_modules` order."""
    if transformer not in _MODULES:
        _MODULES[transformer] = [m for name, m in transformer.named_modules()
                                 if any(re.fullmatch(p, name) for p in _TRANSFORMER_BLOCK_IDENTIFIERS)]
    return _MODULES[transformer]


class Plan:
    """One forward's row groups and the attention modules they skip on the steps they predict."""

    def __init__(self, modules: list[torch.nn.Module], groups: list[Group], loras=None):
        self.modules, self.groups, self.loras = modules, groups, loras  # loras: the rows' LoRA library
        self.view = [(g, g.rows) for g in groups]  # the groups the modules see now, and their rows in the call

    @contextlib.contextmanager
    def only(self, rows: Optional[list[int]]):
        """While the blocks run over the forward's rows `rows` only (host ints; None: all): the first-block
        cache's rows that compute (whole groups, in order)."""
        if rows is None:
            yield
            return
        kept, view, start = set(rows), [], 0
        for g in self.groups:
            if g.rows.start in kept:
                n = g.rows.stop - g.rows.start
                view.append((g, slice(start, start + n)))
                start += n
        saved, self.view = self.view, view
        try:
            yield
        finally:
            self.view = saved

    @contextlib.contextmanager
    def attending(self):
        """Each attention module runs through `_attend` while the forward runs."""
        saved = [m.__dict__.get("forward") for m in self.modules]
        for k, module in enumerate(self.modules):
            module.forward = functools.partial(self._attend, k, module.forward)
            _RUNNING[module] = (self, k)
        try:
            yield
        finally:
            for module, forward in zip(self.modules, saved):
                _RUNNING.pop(module, None)
                if forward is None:
                    del module.forward
                else:
                    module.forward = forward

    def _attend(self, k: int, forward, *args, **kwargs):
        """Module `k` over the rows that compute; each group renews or predicts its own factors."""
        assert not args, "the blocks call attention by keyword"
        computing = [s for g, s in self.view if g.computes]
        total = sum(s.stop - s.start for _, s in self.view)
        out = None
        if len(computing) == len(self.view):
            out = forward(**kwargs)
        elif computing:
            rows = [r for s in computing for r in range(s.start, s.stop)]
            index = to_device(rows, kwargs["hidden_states"].device)
            with contextlib.nullcontext() if self.loras is None else self.loras.only(rows):  # each row its LoRA
                out = forward(**{name: value.index_select(0, index) if name in PER_ROW and isinstance(
                    value, torch.Tensor) and value.shape[0] == total else value for name, value in kwargs.items()})
        single = isinstance(out, torch.Tensor)
        outputs = (out,) if single else out
        # each output has the tokens of its stream's input (a joint attention returns image, then text)
        tokens = [kwargs[name].shape[1] for name in ("hidden_states", "encoder_hidden_states")
                  if kwargs.get(name) is not None]
        pieces, taken = [], 0
        for group, rows in self.view:
            n = rows.stop - rows.start
            if group.computes:
                piece = [o[taken:taken + n] for o in outputs]
                taken += n
                if group.factors is not None:
                    group.factors[k].update(piece, group.step)
            else:
                piece = [fit(p, length) for p, length in zip(group.factors[k].predict(group.step), tokens)]
                single = len(piece) == 1
            pieces.append(piece)
        if len(computing) == len(self.view):
            return out
        joined = tuple(torch.cat([p[i] for p in pieces]) for i in range(len(pieces[0])))
        return joined[0] if single else joined


    def _attend_packed(self, k: int, attend, packing, img: torch.Tensor, txt: torch.Tensor, per_row: tuple,
                       joined: bool):
        """`_attend` for a packed forward's attention `attend(packing, img, txt, *per_row)` -> (image [1, T, ...]
        packed, text [R, L, ...]). A group's module outputs are [its image tokens, its text rows], or with
        `joined` one [text; image] output."""
        computing = [s for g, s in self.view if g.computes]
        own, out = packing, None
        if len(computing) == len(self.view):
            out = attend(packing, img, txt, *per_row)
        elif computing:
            rows = [r for s in computing for r in range(s.start, s.stop)]
            index, own = to_device(rows, txt.device), packing.subset(rows)
            padded = packing.unpack(img).index_select(0, index)[:, :own.longest]
            with contextlib.nullcontext() if self.loras is None else self.loras.only(rows), \
                    contextlib.nullcontext() if self.loras is None else self.loras.packed(own.token_rows):
                out = attend(own, own.pack(padded), txt.index_select(0, index),
                             *(x if x is None else x.index_select(0, index) for x in per_row))
        own_img = None if out is None else own.unpack(out[0])
        pieces, taken = [], 0
        for group, rows in self.view:
            n, length = rows.stop - rows.start, packing.lengths[rows.start]
            if group.computes:
                piece = [own_img[taken:taken + n, :length], out[1][taken:taken + n]]
                taken += n
                if group.factors is not None:
                    group.factors[k].update([torch.cat(piece[::-1], dim=1)] if joined else piece, group.step)
            else:
                piece = group.factors[k].predict(group.step)
                if joined:
                    piece = [piece[0][:, txt.shape[1]:], piece[0][:, :txt.shape[1]]]
                else:
                    piece = [piece[0], fit(piece[1], txt.shape[1])]
            pieces.append(piece)
        if len(computing) == len(self.view):
            return out
        image = torch.cat([F.pad(p[0], (0, 0, 0, packing.longest - p[0].shape[1])) for p in pieces])
        return packing.pack(image), torch.cat([p[1] for p in pieces])


def packed_attention(module: torch.nn.Module, attend, packing, img: torch.Tensor, txt: torch.Tensor, *per_row,
                     joined: bool = False):
    """The attention module `module` of a packed forward, as `attend(packing, img, txt, *per_row)` runs it
    (image [1, T, ...] packed, text [R, L, ...]; `per_row`: other per-row tensors or None): under the running
    TaylorSeer plan, the rows that compute run it and the others predict (`Plan._attend_packed`)."""
    running = _RUNNING.get(module)
    if running is None:
        return attend(packing, img, txt, *per_row)
    seer, k = running
    return seer._attend_packed(k, attend, packing, img, txt, per_row, joined)


def running(transformer: torch.nn.Module) -> Optional[Plan]:
    """The plan the transformer's forward runs under now (None: none), for forwards that hand it on."""
    modules = attention_modules(transformer)
    return _RUNNING[modules[0]][0] if modules and modules[0] in _RUNNING else None


def plan(transformer: torch.nn.Module, states: list, branches: tuple[str, ...],
         tally: Optional[Counter] = None, loras=None) -> Optional[Plan]:
    """The plan of a forward whose rows are `branches` halves (each every state's rows in batch order); None
    when no state uses TaylorSeer. `tally` counts each TaylorSeer group's decision ("computed", "reused");
    `loras`: the rows' LoRA library (the rows that compute attend under their own LoRAs)."""
    if not any(caches(s.params) for s in states):
        return None
    modules = attention_modules(transformer)
    groups, start = [], 0
    for branch in branches:
        for state in states:
            rows = slice(start, start + state.num_rows)
            start += state.num_rows
            if not caches(state.params):
                groups.append(Group(rows))
                continue
            factors = state.step_cache.setdefault(branch, [ModuleFactors() for _ in modules])
            groups.append(Group(rows, state.step_index, factors))
            if tally is not None:
                tally["computed" if computes(state.step_index) else "reused"] += 1
    return Plan(modules, groups, loras)


def attending(seer: Optional[Plan]):
    """`seer.attending()`, or nothing without a plan."""
    return contextlib.nullcontext() if seer is None else seer.attending()
