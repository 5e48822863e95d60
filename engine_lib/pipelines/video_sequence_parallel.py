"""Sequence parallel (Ulysses) for the video pipelines (LTX-2, Helios): each transformer call's tokens split over
`sequence_parallel_size` ranks through a context-parallel plan.

Video is where the tokens are many (frames x height x width), so it is where splitting them pays. The driver (the
engine's process) keeps every request's state and builds each transformer call's arguments exactly as in one
process; `transformer_call` sends them to every rank (the same arguments to each), and each rank runs the call
through its transformer with diffusers' context parallelism: the plan's hooks give each rank its share of the
tokens, the attention exchanges heads for tokens (an all_to_all before and after it), and the plan's gathers
join the shares again, so every rank ends with the whole output and rank 0's comes back. Only the transformer
runs on the ranks: the guidance, the scheduler steps and the decode stay the adapter's own.

The plan is the adapter's `context_parallel_plan(transformer)`: the model's `_cp_plan` with its gathers, fitted
to the checkpoint (ltx2/context_parallel.py, helios/context_parallel.py).

One shim on CPU ranks: the plan's gathers join shares of different sizes (`tensor_split` of any token count),
which gloo's all_gather refuses (it takes equal sizes); there each share is padded to the longest and cut back
after the gather (`gather_shares`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine_lib.config import EngineConfig
from engine_lib.parallel import DEFAULT_TIMEOUT_S, WorkerGroup, agree, start_pipeline_ranks
from engine_lib.pipelines.sequence_parallel import enable_ulysses


def start(adapter_cls: type, model_path: str, device: torch.device, dtype: torch.dtype, config: EngineConfig,
          timeout_s: float = DEFAULT_TIMEOUT_S) -> WorkerGroup:
    """`sequence_parallel_size` workers, each loading the pipeline on its device (CPUs over gloo, or one GPU each)."""
    degree = config.parallel.sequence_parallel_size
    return start_pipeline_ranks(TransformerRank, adapter_cls, model_path, device, dtype, config, degree, timeout_s)


def transformer_call(adapter, context: str, **kwargs):
    """`adapter.pipe.transformer(**kwargs)` in the transformer's cache context `context`: on the adapter's ranks
    when it has them (the output moved back to the adapter's device), else in this process."""
    if adapter.workers is None:
        with adapter.pipe.transformer.cache_context(context):
            return adapter.pipe.transformer(**kwargs)
    output = adapter.workers.call("forward", [(context, kwargs)] * adapter.workers.world_size)
    return tuple(part.to(adapter.device) for part in output)


class TransformerRank:
    """One rank's handler: its share of the tokens of each transformer call."""

    def __init__(self, adapter, rank: int, world_size: int):
        self.adapter, self.rank = adapter, rank
        from diffusers.hooks import context_parallel

        if dist.get_backend() == "gloo":
            context_parallel._all_gather_anything = gather_shares
        transformer = adapter.pipe.transformer
        plan = transformer._cp_plan = adapter.context_parallel_plan(transformer)  # this rank's model's own
        enable_ulysses(transformer, world_size, adapter.device)  # the plan's splits (and the attention's exchange)
        gathers = {name: entry for name, entry in plan.items() if not isinstance(entry, dict)}
        context_parallel.apply_context_parallel(transformer, transformer._parallel_config.context_parallel_config,
                                                gathers)

    @torch.inference_mode()
    def forward(self, context: str, kwargs: dict):
        """Rank 0: the call's whole output (a tuple of tensors); the other ranks: None."""
        failed, output = None, None
        try:
            with self.adapter.pipe.transformer.cache_context(context):
                output = self.adapter.pipe.transformer(**kwargs)
        except Exception as error:
            failed = error
        agree(failed, self.adapter.device)  # every rank learns whether every call ran: they stay in step
        return tuple(output) if self.rank == 0 else None


def gather_shares(share: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's share of a tensor joined along `dim` in rank order, the shares' sizes along it may differ (each
    padded to the longest for one all_gather, then cut back)."""
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([share.shape[dim]]), group=group)
    sizes = [int(size) for size in sizes]
    pad = [0, 0] * (share.dim() - 1 - dim % share.dim()) + [0, max(sizes) - share.shape[dim]]
    padded = F.pad(share, pad).contiguous()
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part.narrow(dim, 0, size) for part, size in zip(parts, sizes)], dim=dim)
