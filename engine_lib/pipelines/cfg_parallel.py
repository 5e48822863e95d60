"""CFG-parallel: a true-CFG tick's two transformer forwards on two ranks (the `cfg_parallel` parameter).

The driver (the engine's process) keeps every request's state, the text encoding, the scheduler
steps and the decode; each tick it sends rank 0 the batch's cond text and rank 1 its uncond text,
with the same latents, timesteps and per-row inputs. Each rank runs the transformer forward of
its half, rank 1's prediction is gathered to rank 0, and rank 0 combines the two with the
adapter's own `_combine_cfg`, the operations of the single-process path, and returns the guided
prediction to the driver. Only the transformer runs on the ranks, so the engine's contracts
(keys, pauses, previews, decode groups) are unchanged. Each row runs under its own LoRA on both
ranks (the call's row plan), and a request's step cache of a branch lives on that branch's rank
(rank_states.py).
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from engine_lib.parallel import DEFAULT_TIMEOUT_S, WorkerGroup, agree, start_pipeline_ranks
from engine_lib.pipelines.rank_states import RankStates, RowFacts

SIDES = ("cond", "uncond")  # rank r runs the rows of SIDES[r]


def start(adapter_cls: type, model_path: str, device: torch.device, dtype: torch.dtype, options: dict,
          timeout_s: float = DEFAULT_TIMEOUT_S) -> WorkerGroup:
    """Two workers, each loading the pipeline on its device (both CPUs over gloo, or cuda:0 and cuda:1)."""
    return start_pipeline_ranks(CfgRank, adapter_cls, model_path, device, dtype, options, len(SIDES), timeout_s)


def forward(group: WorkerGroup, latents: torch.Tensor, timestep: torch.Tensor, text: dict, rows: dict,
            scale: float, facts: list[RowFacts], plan: list, tally: Counter) -> torch.Tensor:
    """The guided prediction of a tick, computed on the ranks, on the latents' device (`plan`: each row's LoRA);
    `tally` (the driver's count of step cache decisions) gets each branch's, made on its rank."""
    args = [(latents, timestep, text[side], rows, scale, facts, plan) for side in SIDES]
    replies = group.call_all("forward", args)
    for _, decisions in replies:
        tally.update(decisions)
    return replies[0][0].to(latents.device)


class CfgRank:
    """One rank's handler: the transformer forward of its CFG side."""

    def __init__(self, adapter, rank: int, world_size: int):
        self.adapter, self.rank = adapter, rank
        self.held = RankStates()

    def held_states(self) -> int:
        """Requests whose step cache (of this rank's branch) this rank holds."""
        return len(self.held)

    def free(self, request_ids: list[str]) -> None:
        self.held.free(request_ids)

    @torch.inference_mode()
    def forward(self, latents, timestep, text, rows, scale, facts, plan):
        """Rank 0: the guided prediction; every rank: its step cache decisions of this call."""
        side = SIDES[self.rank]
        failed = None
        self.adapter.cache_steps.clear()
        try:
            states = self.held.states(facts)
            with self.adapter._cache_context(side), self.adapter.loras.rows(plan):
                pred = self.adapter._transformer(latents, timestep, text, {**rows, "branches": (side,)}, states)
        except Exception as error:
            failed, pred = error, torch.zeros_like(latents)
        agree(failed, latents.device)  # every rank learns whether both forwards ran: they stay in step
        preds = [torch.empty_like(pred) for _ in SIDES] if self.rank == 0 else None
        dist.gather(pred.contiguous(), preds, dst=0)
        decisions = dict(self.adapter.cache_steps)
        if self.rank != 0:
            return None, decisions
        return self.adapter._combine_cfg(preds[0], preds[1], scale), decisions
