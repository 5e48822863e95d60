"""Sequence parallel (Ulysses): each forward's tokens split over the ranks (the `sequence_parallel_size` parameter).

The driver (the engine's process) keeps every request's state, the text encoding, the scheduler
steps and the decode; each tick it sends every rank the same inputs: the batch's latents,
timesteps, the text of the forwards it runs, per-row inputs and the CFG scale. Each rank runs
the adapter's own prediction (`_predict`: the cond forward, or both CFG forwards, batched or not
as `cfg_batching` says, and their combination) through a transformer with diffusers' context
parallelism: `ContextParallelConfig(ulysses_degree=n, ulysses_anything=True)` and the model's own
`_cp_plan` (Qwen-Image, Flux). The plan's hooks give each rank its share of the image and of the
text tokens (`tensor_split`: any count of at least n, so no padding), and the attention exchanges
heads for tokens with an all_to_all before and after it, so each rank attends over the whole
joint sequence with its share of the heads. The plan's final all_gather is left out: rank 0
alone needs the prediction, so the ranks' token shards are gathered to it (`gather_tokens`).

One shim makes diffusers' context parallel run on CPU ranks over gloo (with the native SDPA
attention our forwards use): it names a rank's device `rank % torch.accelerator.device_count()`,
a division by zero on a host without an accelerator, so there the count reads 1 while the
parallelism is enabled (the device it names is not used; the mesh is ours, on the rank's device).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine_lib.config import EngineConfig
from engine_lib.parallel import DEFAULT_TIMEOUT_S, WorkerGroup, agree, start_pipeline_ranks
from engine_lib.pipelines.rank_states import RankHandler, RowFacts


def start(adapter_cls: type, model_path: str, device: torch.device, dtype: torch.dtype, config: EngineConfig,
          timeout_s: float = DEFAULT_TIMEOUT_S) -> WorkerGroup:
    """`sequence_parallel_size` workers, each loading the pipeline on its device (CPUs over gloo, or one GPU each)."""
    degree = config.parallel.sequence_parallel_size
    return start_pipeline_ranks(SequenceRank, adapter_cls, model_path, device, dtype, config, degree, timeout_s)


def forward(group: WorkerGroup, latents: torch.Tensor, timestep: torch.Tensor, text: dict, rows: dict,
            scale: Optional[float], cfg_batching: bool, facts: list[RowFacts], plan: list,
            tally: Counter) -> torch.Tensor:
    """A tick's prediction (guided with a CFG `scale`), computed on the ranks, on the latents' device (`plan`:
    each row's LoRA); `tally` (the driver's count of step cache decisions) gets rank 0's (every rank decides
    alike)."""
    sides = ("cond",) if scale is None else ("cfg",) if cfg_batching else ("cond", "uncond")
    args = (latents, timestep, {side: text[side] for side in sides}, rows, scale, cfg_batching, facts, plan)
    prediction, decisions = group.call("forward", [args] * group.world_size)
    tally.update(decisions)
    return prediction.to(latents.device)


def gather_tokens(shard: torch.Tensor, tokens: int, rank: int, world_size: int,
                  degree: Optional[int] = None) -> Optional[torch.Tensor]:
    """Rank 0: the ranks' shards of a [B, tokens, C] output joined, each rank's at the offset `tensor_split` gave
    it; the other ranks: None. The ranks form groups of `degree` consecutive ranks (default: one group of all),
    each group's shards joined along the tokens in rank order and the groups' outputs along the rows (cfg_parallel:
    the cond then the uncond rows). The shards are padded to the first (the longest) for one gather."""
    degree = degree or world_size
    sizes = [len(part) for part in torch.arange(tokens).tensor_split(degree)] * (world_size // degree)
    padded = F.pad(shard, (0, 0, 0, sizes[0] - shard.shape[1])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(world_size)] if rank == 0 else None
    dist.gather(padded, parts, dst=0)
    if rank != 0:
        return None
    joined = torch.cat([part[:, :size] for part, size in zip(parts, sizes)], dim=1)
    return torch.cat(joined.split(tokens, dim=1))


@dataclass(frozen=True)
class TokenShare:
    """A rank's share of a forward's tokens under the transformer's context parallelism: what the plan's hooks split
    (`split`, their own sharder), and sums over every rank of its Ulysses group (`total`), so a decision over the
    whole sequence (the first-block cache's) is the same on every rank."""

    mesh: Any  # the group's DeviceMesh (ring x ulysses, flattened), as the hooks split over it

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        from diffusers.hooks.context_parallel import PartitionAnythingSharder

        return PartitionAnythingSharder.shard_anything(x, dim, self.mesh)

    def total(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.mesh.get_group())
        return x


def token_share(transformer: torch.nn.Module) -> Optional[TokenShare]:
    """The transformer's TokenShare on a sequence-parallel rank (None: it runs every token itself)."""
    config = getattr(transformer, "_parallel_config", None)
    context = None if config is None else config.context_parallel_config
    return None if context is None else TokenShare(context._flattened_mesh)


def enable_ulysses(transformer: torch.nn.Module, degree: int, device: torch.device) -> None:
    """diffusers' Ulysses context parallelism over the process group, its plan without the output's all_gather."""
    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    plan = {name: entry for name, entry in transformer._cp_plan.items() if isinstance(entry, dict)}  # the splits
    # One Ulysses group per `degree` consecutive ranks (cfg_parallel's CFG groups: the "cfg" dimension).
    groups = dist.get_world_size() // degree
    mesh = init_device_mesh(device.type, (groups, 1, degree), mesh_dim_names=("cfg", "ring", "ulysses"))
    config = ContextParallelConfig(ulysses_degree=degree, ulysses_anything=True, mesh=mesh)
    no_accelerator = torch.accelerator.device_count() == 0
    with mock.patch.object(torch.accelerator, "device_count", return_value=1) if no_accelerator \
            else contextlib.nullcontext():
        transformer.enable_parallelism(config=config, cp_plan=plan)


class SequenceRank(RankHandler):
    """One rank's handler: its share of the tokens of a tick's forwards."""

    def __init__(self, adapter, rank: int, world_size: int):
        super().__init__(adapter, rank, world_size)
        enable_ulysses(adapter.pipe.transformer, world_size, adapter.device)

    @torch.inference_mode()
    def forward(self, latents, timestep, text, rows, scale, cfg_batching, facts, plan):
        """Rank 0: the prediction and its step cache decisions of this call; the other ranks: None."""
        failed, shard = None, None
        self.adapter.cfg_batching = cfg_batching  # the driver's: it sent the text of those forwards
        self.adapter.cache_steps.clear()
        try:
            with self.adapter.loras.rows(plan):
                shard = self.adapter._predict(latents, timestep, text, rows, self.held.states(facts), scale)
        except Exception as error:
            failed = error
        agree(failed, latents.device)  # every rank learns whether all forwards ran: they stay in step
        prediction = gather_tokens(shard, latents.shape[1], self.rank, self.world_size)
        return None if prediction is None else (prediction, dict(self.adapter.cache_steps))
