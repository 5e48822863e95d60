"""A per-request first-block cache inside a shared step batch (diffusers' `FirstBlockCache`, decided per row group).

diffusers' hook (diffusers/hooks/first_block_cache.py) keeps one state per cache context (Qwen-Image's
and Flux's pipelines run "cond" and "uncond" as two transformer calls) and decides for the whole forward: after the
first block, the mean absolute change of its residual (output minus input of the image stream) relative to
the residual of the last step that ran every block, `mean|r - r_prev| / mean|r_prev|`; at or below the
threshold the other blocks are skipped and the last block's output is taken as the first block's output
plus the residual the other blocks added at that last full step.

Here the same math runs per row group: one request x one CFG branch (its `num_images` rows, as diffusers'
decision spans its batch). The groups of a step batch decide independently from their own residuals, so
requests with the cache on and off, and different thresholds, share a forward; only the groups that compute
run the blocks after the first. The cached residuals are the request's: `FlowMatchState.step_cache`, one
`BranchCache` per branch, moved with the state when it pauses and freed with it. Each pipeline's
`first_block.py` hands its block loop to `run_joint_blocks` (qwen_image/, flux/, sd3/), which takes the rows
that compute, their text stream and LoRA plan around `run_blocks`.

The `cache` input's other method, TaylorSeer (`cache_input("first_block", "taylorseer")`, on the pipelines
whose forward runs it), is taylorseer.py; its rows count as computing here and share the forward.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from engine_lib.host_copy import to_device
from engine_lib.interface import InputSpec

CACHE_MODES = ("none", "first_block")
DEFAULT_THRESHOLD = 0.05  # FirstBlockCacheConfig's default
MODE_DOCS = {"first_block": "first_block (a step whose first transformer block changed little reuses the other "
                            "blocks' last residual)",
             "taylorseer": "taylorseer (diffusers' TaylorSeer: the steps between those that compute predict the "
                           "attention outputs from the last ones)"}


def cache_input(*modes: str) -> InputSpec:
    """The `cache` input of a pipeline whose forward runs `modes` (besides none)."""
    # No declared default, so a deployer's `default_cache` parameter sets it (interface.py).
    return InputSpec("cache", "BYTES", "step cache: none (absent: the model's default_cache, else none), "
                     + " or ".join(MODE_DOCS[m] for m in modes), choices=("none", *modes), high=16, batch="row")


CACHE = cache_input("first_block")
CACHE_THRESHOLD = InputSpec("cache_threshold", "FP32", "first_block: the relative change of the first block's "
                            f"residual at or below which a step reuses the cache (absent: default_cache_threshold, "
                            f"else {DEFAULT_THRESHOLD}; higher: faster, less faithful)", low=0, high=1, batch="row",
                            only_with=("cache", ("first_block",)))
CACHE_INPUTS = (CACHE, CACHE_THRESHOLD)
ALL_CACHE_INPUTS = (cache_input("first_block", "taylorseer"), CACHE_THRESHOLD)  # with TaylorSeer too (taylorseer.py)


@dataclass
class BranchCache:
    """One CFG branch of one request, as diffusers' `FBCSharedBlockState` holds it for one cache context."""

    head_residual: Optional[torch.Tensor] = None  # the first block's residual at the last step that computed
    tail_residual: Optional[torch.Tensor] = None  # the last block's output minus the first's, at that step


@dataclass
class RowGroup:
    """Rows [rows] of a forward: one request's rows of one CFG branch."""

    rows: slice
    threshold: Optional[float]  # None: this request does not cache (it always computes)
    cache: Optional[BranchCache]
    tokens: Optional[int] = None  # its own image tokens, where the forward pads rows to a longer one (mixed sizes)
    tally: Optional[Counter] = None  # the adapter's count of decisions ("computed", "reused"), for the metrics

    def own(self, x: torch.Tensor) -> torch.Tensor:
        """This group's rows of a per-row tensor [R, S, ...], without padding."""
        x = x[self.rows]
        return x if self.tokens is None else x[:, :self.tokens]


def caches(params) -> bool:
    """Whether the request asked for the first-block cache (or the deployment's default_cache did)."""
    return params.get("cache") == "first_block"


def threshold(params) -> float:
    """The request's threshold, as a Python float (diffusers compares the ratio's `.item()` with its float)."""
    value = params.get("cache_threshold")
    return DEFAULT_THRESHOLD if value is None else float(value)


def row_groups(states: list, branches: tuple[str, ...], tokens: Optional[list[int]] = None,
               tally: Optional[Counter] = None) -> Optional[list[RowGroup]]:
    """The groups of a forward whose rows are `branches` halves (cond, or cond and uncond), each half every
    state's rows in batch order (`tokens`: each state's own image tokens, in a padded forward; `tally`: counts
    each caching group's decision); None when no state caches (the forward runs as diffusers' own)."""
    if not any(caches(s.params) for s in states):
        return None
    groups, start = [], 0
    for branch in branches:
        for i, state in enumerate(states):
            rows = slice(start, start + state.num_rows)
            start += state.num_rows
            if caches(state.params):
                groups.append(RowGroup(rows, threshold(state.params),
                                       state.step_cache.setdefault(branch, BranchCache()), tokens and tokens[i],
                                       tally))
            else:
                groups.append(RowGroup(rows, None, None, tokens and tokens[i]))
    return groups


def should_compute(groups: list[RowGroup], head_residual: torch.Tensor, share=None) -> list[bool]:
    """diffusers' `_should_compute_remaining_blocks` for each group, from its own rows of `head_residual`: a
    group without a previous residual (its first step) or without caching computes. One host read per tick
    for all the groups that compare. On a sequence-parallel rank (`share`: sequence_parallel.TokenShare) each rank
    holds its share of the tokens: the change is the ratio of the sums over every rank's tokens (the ratio of the
    means), so every rank decides alike."""
    compared = [g for g in groups if g.threshold is not None and g.cache.head_residual is not None]
    diffs = {}
    if compared:
        values = []
        for g in compared:
            prev = g.cache.head_residual
            if share is None:
                absmean = (g.own(head_residual) - prev).abs().mean()
                values.append(absmean / prev.abs().mean())
            else:
                values.append(torch.stack([(g.own(head_residual) - prev).abs().sum(), prev.abs().sum()]))
        values = torch.stack(values)
        if share is not None:
            sums = share.total(values)
            values = sums[:, 0] / sums[:, 1]
        diffs = dict(zip(map(id, compared), values.tolist()))
    compute = [id(g) not in diffs or diffs[id(g)] > g.threshold for g in groups]
    if share is not None and compared:  # a rank that skips while another computes would wait in its collectives
        agreed = share.total(to_device(compute, head_residual.device, torch.int32)).tolist()
        if any(n not in (0, share.mesh.size()) for n in agreed):
            raise RuntimeError(f"the sequence-parallel ranks' first-block cache decisions differ: {agreed}")
    return compute


def run_blocks(groups: Optional[list[RowGroup]], img: torch.Tensor, head, rest, share=None,
               head_in: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The image stream after every block. `head(img)` runs the first block over every row and returns its image
    output; `rest(img, rows, index)` runs the other blocks over the rows `rows` (host ints; `index` the same on the
    device; both None: every row), `img` being those rows of the first block's output, and returns their image
    output.

    Without groups every row runs every block. With them, each group that computes keeps its first block's
    residual and the residual the other blocks added (diffusers' head and tail residuals); each group that does
    not leaves after the first block, with its last tail residual added (`tail + head output`, diffusers' order).

    On a sequence-parallel rank (`share`) the groups decide over every rank's tokens (`should_compute`); `head_in`
    is the first block's input as its output's tokens, where the first block takes the rank's share itself.
    """
    head_in = img if head_in is None else head_in
    img = head(img)
    if groups is None:
        return rest(img, None, None)
    head_residual = img - head_in
    compute = should_compute(groups, head_residual, share)
    for group, computes in zip(groups, compute):
        if group.tally is not None:
            group.tally["computed" if computes else "reused"] += 1
    rows = [r for g, c in zip(groups, compute) if c for r in range(g.rows.start, g.rows.stop)]
    if len(rows) == img.shape[0]:
        out, computed = rest(img, None, None), img
    elif rows:
        index = to_device(rows, img.device)
        computed = img.index_select(0, index)
        out = rest(computed, rows, index)
    own = len(groups) > 1  # a group's residuals are copies, so a request's cache holds no other request's rows
    pieces, taken = [], 0
    for group, computes in zip(groups, compute):
        n = group.rows.stop - group.rows.start
        if computes:
            piece = out[taken:taken + n]
            if group.cache is not None:
                head_rows = group.own(head_residual)
                tail = piece - computed[taken:taken + n]
                tail = tail if group.tokens is None else tail[:, :group.tokens]
                group.cache.head_residual = head_rows.clone() if own else head_rows
                group.cache.tail_residual = tail
            taken += n
        else:
            tail = group.cache.tail_residual
            piece = F.pad(tail, (0, 0, 0, img.shape[1] - tail.shape[1])) if tail.shape[1] != img.shape[1] else tail
            piece = piece + img[group.rows]
        pieces.append(piece)
    return out if len(rows) == img.shape[0] else torch.cat(pieces)


def take(x: Optional[torch.Tensor], index: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The rows `index` of a per-row tensor (index None: every row; a None input stays None)."""
    return x if x is None or index is None else x.index_select(0, index)


def run_joint_blocks(groups: Optional[list[RowGroup]], loras, img: torch.Tensor, txt: torch.Tensor, per_row: tuple,
                     run, packing=None, seer=None, share=None, head_in=None) -> torch.Tensor:
    """`run_blocks` for blocks that carry an image and a text stream. `run(which, img, txt, *per_row)` runs the
    blocks `blocks[which]` (a slice) and returns (img, txt); the rows that compute run the blocks after the first
    under their own LoRA plan, with their rows of the first block's text output and of `per_row` (the other
    per-row inputs: timestep embedding, text mask).

    With `packing`, `img` is the padded [R, longest, ...] layout and `run` gets the packed stream and its packing
    last: the rows that compute are packed on their own (`packing.subset`, made in that tick) under their tokens'
    LoRA plan (every row: the caller's plan holds). `seer`: the forward's TaylorSeer plan (taylorseer.py), told
    which rows run the blocks after the first. `share`, `head_in`: on a sequence-parallel rank (`run_blocks`)."""
    head_txt = []

    def blocks(which, img, txt, per_row, rows):
        if packing is None:
            return run(which, img, txt, *per_row)
        own = packing if rows is None else packing.subset(rows)
        with contextlib.nullcontext() if rows is None else loras.packed(own.token_rows):
            out, txt = run(which, own.pack(img[:, :own.longest]), txt, *per_row, own)
        out = own.unpack(out)
        return (out if out.shape[1] == img.shape[1] else F.pad(out, (0, 0, 0, img.shape[1] - out.shape[1]))), txt

    def head(img):
        img, out_txt = blocks(slice(0, 1), img, txt, per_row, None)
        head_txt.append(out_txt)
        return img

    def rest(img, rows, index):
        with contextlib.nullcontext() if rows is None else loras.only(rows), \
                contextlib.nullcontext() if seer is None else seer.only(rows):
            return blocks(slice(1, None), img, take(head_txt[0], index), [take(x, index) for x in per_row], rows)[0]

    return run_blocks(groups, img, head, rest, share, head_in)
