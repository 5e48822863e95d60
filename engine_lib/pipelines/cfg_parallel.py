"""CFG-parallel: a true-CFG tick's two transformer forwards on two groups of ranks (the `cfg_parallel` parameter).

The driver (the engine's process) keeps every request's state, the text encoding, the scheduler
steps and the decode; each tick it sends the first group the batch's cond text and the second its
uncond text, with the same latents, timesteps and per-row inputs. Each group runs the transformer
forward of its half, and rank 0 combines the two predictions with the adapter's own `_combine_cfg`,
the operations of the single-process path, and returns the guided prediction to the driver (a tick
without CFG: the first group's cond forward alone, the second group idle). Only
the transformer runs on the ranks, so the engine's contracts (keys, pauses, previews, decode
groups) are unchanged. Each row runs under its own LoRA on every rank (the call's row plan), and
a request's step cache of a branch lives on that branch's ranks (rank_states.py).

A group is one rank, or with `sequence_parallel_size` n > 1 n ranks (2n in all: ranks 0..n-1 run
the cond forward, n..2n-1 the uncond one) that split that forward's tokens with Ulysses attention
among themselves (sequence_parallel.py: each group its own all_to_all); the ranks' token shards
are gathered to rank 0, each group's joined along the tokens (`sequence_parallel.gather_tokens`).
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

import torch

from engine_lib.config import EngineConfig
from engine_lib.parallel import DEFAULT_TIMEOUT_S, WorkerGroup, agree, start_pipeline_ranks
from engine_lib.pipelines.rank_states import RankHandler, RowFacts
from engine_lib.pipelines.sequence_parallel import enable_ulysses, gather_tokens

SIDES = ("cond", "uncond")  # group g runs the rows of SIDES[g]


def start(adapter_cls: type, model_path: str, device: torch.device, dtype: torch.dtype, config: EngineConfig,
          timeout_s: float = DEFAULT_TIMEOUT_S) -> WorkerGroup:
    """Two groups of `sequence_parallel_size` workers, each loading the pipeline on its device (CPUs over gloo,
    or one GPU each)."""
    degree = config.parallel.sequence_parallel_size
    return start_pipeline_ranks(CfgRank, adapter_cls, model_path, device, dtype, config, len(SIDES) * degree,
                                timeout_s)


def forward(group: WorkerGroup, latents: torch.Tensor, timestep: torch.Tensor, text: dict, rows: dict,
            scale: Optional[float], facts: list[RowFacts], plan: list, tally: Counter) -> torch.Tensor:
    """The guided prediction of a tick (without a CFG `scale`: the cond prediction, the first group's forward
    alone), computed on the ranks, on the latents' device (`plan`: each row's LoRA); `tally` (the driver's count of
    step cache decisions) gets each branch's, made on its ranks (each group's first rank answers for its group:
    its ranks decide alike)."""
    degree = group.world_size // len(SIDES)
    sent = {side: text[side] for side in (SIDES if scale is not None else SIDES[:1])}
    args = [(latents, timestep, sent.get(side), rows, scale, facts, plan) for side in SIDES for _ in range(degree)]
    replies = group.call_all("forward", args)
    for _, decisions in replies:
        tally.update(decisions)
    return replies[0][0].to(latents.device)


class CfgRank(RankHandler):
    """One rank's handler: the transformer forward of its CFG side (its share of the tokens, in a group of
    several ranks)."""

    def __init__(self, adapter, rank: int, world_size: int):
        super().__init__(adapter, rank, world_size)
        self.degree = world_size // len(SIDES)  # ranks per CFG group
        if self.degree > 1:
            enable_ulysses(adapter.pipe.transformer, self.degree, adapter.device)

    @torch.inference_mode()
    def forward(self, latents, timestep, text, rows, scale, facts, plan):
        """Rank 0: the guided prediction (`text` None on the second group's ranks: a tick without CFG, the cond
        prediction); each group's first rank: its step cache decisions of this call."""
        side = SIDES[self.rank // self.degree]
        failed, pred = None, torch.zeros_like(latents[:, :1])  # (an idle rank's share: padded, then left out)
        self.adapter.cache_steps.clear()
        try:
            if text is not None:
                states = self.held.states(facts)
                with self.adapter._cache_context(side), self.adapter.loras.rows(plan):
                    pred = self.adapter._transformer(latents, timestep, text, {**rows, "branches": (side,)}, states)
        except Exception as error:
            failed = error
        agree(failed, latents.device)  # every rank learns whether both forwards ran: they stay in step
        preds = gather_tokens(pred, latents.shape[1], self.rank, self.world_size, self.degree)
        decisions = dict(self.adapter.cache_steps) if self.rank % self.degree == 0 else {}
        if self.rank != 0:
            return None, decisions
        preds = preds.chunk(len(SIDES))
        if scale is None:
            return preds[0], decisions
        return self.adapter._combine_cfg(preds[0], preds[1], scale), decisions
