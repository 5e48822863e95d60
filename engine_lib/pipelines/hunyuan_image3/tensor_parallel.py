"""HunyuanImage-3.0 over several devices: tensor parallel (`tensor_parallel_size`) and expert parallel
(`expert_parallel`), the ranks loading only their shards of the checkpoint.

The split (Megatron's, W ranks, rank r):

* attention: rank r holds KV heads [r KV/W, (r+1) KV/W) and their query heads (the fused `qkv_proj` is
  grouped per KV head, so its rows are one contiguous block) and the matching columns of `o_proj`; the
  ranks' `o_proj` outputs are partial sums, all-reduced;
* the shared MLP: rank r holds block r of the gate and of the up rows of `gate_and_up_proj` and the matching
  columns of `down_proj`; its output is a partial sum too;
* the routed experts: split like the shared MLP, each rank computing every expert on its slice; with
  `expert_parallel`, rank r owns experts [r E/W, (r+1) E/W) whole and computes only those, for the tokens
  routed to them (the router is replicated: every rank chooses the same experts). The shared MLP's and the
  experts' partial outputs add up in one all-reduce per layer;
* the token embedding: rank r holds vocabulary rows block r (the others' rows read as zeros, all-reduced);
* the image tokens' way in and out, the timestep embedders and the norms: replicated (small).

The driver (the engine's process) keeps the tokenizer, the VAE decoder, every request's latents and the
scheduler steps; its pipeline's transformer is a `RankedModel`, which hands `prefill` and `predict` to the
ranks. A prompt's KV cache is made on the ranks by `prefill`, each rank keeping its own heads' keys and
values under a key the driver holds in the request's state: it stays there while the request is paused
and is freed when the request's state is dropped (`HunyuanImage3Adapter.release`: finished, failed,
aborted or cancelled). Rank 0 returns each row's prediction; the CFG combination and the Euler step stay on
the driver, in the single-process code.

A think / recaption text phase runs there too: its context is a prompt KV cache like the others, split by head;
each token's forward (`text_logits`) grows every row's cache on the ranks and ends in the vocabulary-split text
head (rank r: `lm_head` rows block r), whose logits are gathered to rank 0. The driver samples the token from
them as one process does, and counts its cache one longer (`RankedTextHead.grown`); a rank trims a cache to the
length the driver counts, so a forward run again (a batch retried row by row) grows it once. The text's cache is
freed on every rank once the image context holds the text, or when the request ends.

The first-block cache (`cache=first_block`) runs on the ranks as in one process (`first_layer_cache`): the first
layer's output is the same on every rank (its partial sums all-reduced), so every rank takes the same decisions;
each row's residuals stay on the ranks beside its KV cache, under its key, and go with it. The driver sends each
row's threshold and counts the decisions rank 0 returns.
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from engine_lib.config import ConfigError, EngineConfig
from engine_lib.parallel import DEFAULT_TIMEOUT_S, WorkerError, WorkerGroup, rank_devices
from engine_lib.pipelines.decoder_parts import KVCache, RMSNorm, grow, held_bytes
from engine_lib.pipelines.hunyuan_image3.model import (Gate, HunyuanConfig, HunyuanImage3Model, MoE, SwiGLU,
                                                      read_config)
from engine_lib.pipelines.hunyuan_image3.think import HEAD_KEYS, extend
from engine_lib.pipelines.step_cache import BranchCache, RowGroup

logger = logging.getLogger(__name__)


def block(size: int, rank: int, world: int) -> slice:
    """Rank r's contiguous share of `size` (the last one shorter when it does not divide)."""
    step = -(-size // world)
    return slice(min(rank * step, size), min((rank + 1) * step, size))


def check_split(config: HunyuanConfig, world: int, expert_parallel: bool) -> None:
    """Every split dimension divides by the ranks (a ConfigError names the one that does not)."""
    sizes = {"num_key_value_heads": config.num_kv_heads, "moe_intermediate_size": config.moe_intermediate_size}
    if expert_parallel:
        sizes["num_experts"] = config.num_experts
    for name, size in sizes.items():
        if size % world:
            raise ConfigError(f"parameter 'tensor_parallel_size': {world} ranks do not divide the checkpoint's "
                              f"{name}={size}")


class RowParallelLinear(nn.Linear):
    """A linear layer holding some of the input columns: its output is a partial sum, all-reduced."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        dist.all_reduce(out)
        return out


class VocabShardEmbedding(nn.Embedding):
    """The embedding rows [start, start + n) of the vocabulary; the others' tokens read zeros, all-reduced."""

    def __init__(self, rows: slice, hidden: int):
        super().__init__(rows.stop - rows.start, hidden)
        self.start = rows.start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = super().forward(local.clamp(0, self.num_embeddings - 1))
        out = torch.where(mine[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device))
        dist.all_reduce(out)
        return out


class VocabShardHead(nn.Module):
    """The text head with `lm_head` rows [start, start + n) of the vocabulary (`model.ln_f` replicated): every
    rank's logits gathered, the whole vocabulary's on every rank (the blocks padded to one size for the gather)."""

    def __init__(self, rows: slice, hidden: int, vocab: int, eps: float, world: int):
        super().__init__()
        self.ln_f = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, rows.stop - rows.start, bias=False)
        self.vocab, self.world, self.step = vocab, world, -(-vocab // world)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.lm_head(self.ln_f(hidden)).float()
        local = nn.functional.pad(local, (0, self.step - local.shape[-1]))
        blocks = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(blocks, local)
        return torch.cat(blocks, dim=-1)[..., :self.vocab]


class RankMoE(MoE):
    """One rank's share of a layer's MoE: its slice of the shared MLP and its experts (`owned`: their
    checkpoint indices, each whole or a slice of width `expert_inner`). The output is the rank's partial
    sum, all-reduced: every token's full output on every rank."""

    def __init__(self, c: HunyuanConfig, world: int, owned: range, expert_inner: int):
        nn.Module.__init__(self)
        self.topk, self.num_experts, self.owned = c.moe_topk, c.num_experts, owned
        self.shared_mlp = SwiGLU(c.hidden_size, c.moe_intermediate_size * c.num_shared_expert // world)
        self.gate = Gate(c.hidden_size, c.num_experts)
        self.experts = nn.ModuleList(SwiGLU(c.hidden_size, expert_inner) for _ in owned)
        self._stack_experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`MoE.forward`'s routing and sums, the (token, slot) pairs of other ranks' experts left out: they sort
        after this rank's groups, outside the grouped matmul's groups, and are zeroed."""
        gates = torch.softmax(nn.functional.linear(x.float(), self.gate.wg.weight.float()), dim=-1)
        weight, chosen = torch.topk(gates, self.topk)
        weight = weight / weight.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(gates.dtype).eps)
        chosen, by_expert = chosen.sort(dim=-1)
        weight = weight.gather(-1, by_expert)
        T, k = chosen.shape
        local = chosen.flatten() - self.owned.start
        mine = (local >= 0) & (local < len(self.owned))
        group = torch.where(mine, local, len(self.owned))  # another rank's expert: one group after ours
        order = group.argsort(stable=True)
        counts = torch.zeros(len(self.owned) + 1, dtype=torch.long, device=x.device).scatter_add_(
            0, group, torch.ones_like(group))
        ends = counts[:-1].cumsum(0).to(torch.int32)
        gate_and_up = nn.functional.grouped_mm(x[order // k], self.stacked["gate_and_up_proj"].transpose(1, 2),
                                               offs=ends)
        x1, x2 = gate_and_up.chunk(2, dim=-1)
        routed = nn.functional.grouped_mm(x1 * nn.functional.silu(x2), self.stacked["down_proj"].transpose(1, 2),
                                          offs=ends)
        routed = torch.where(mine[order, None], routed * weight.flatten()[order, None].to(x.dtype),
                             torch.zeros((), dtype=x.dtype, device=x.device))  # rows past the groups: undefined
        slots = torch.empty_like(routed).index_copy_(0, order, routed).view(T, k, -1)
        out = torch.zeros_like(x)
        for slot in range(k):
            out = out + slots[:, slot]
        out = self.shared_mlp(x) + out
        dist.all_reduce(out)
        return out


# -- sharded loading ----------------------------------------------------------------------------

class Checkpoint:
    """The folder's safetensors shards opened lazily: `read(key, rows, cols)` reads only that slice."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
                 else sorted(p.name for p in folder.glob("*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no safetensors files in {folder}")
        self.files = {name: safe_open(str(folder / name), framework="pt") for name in files}
        self.where = {key: f for f in self.files.values() for key in f.keys()}

    def read(self, key: str, rows: slice = slice(None), cols: Optional[slice] = None) -> torch.Tensor:
        if key not in self.where:
            raise KeyError(f"model weights: {key} is missing")
        part = self.where[key].get_slice(key)
        return part[rows] if cols is None else part[rows, cols]


def rank_model(folder: Path, rank: int, world: int, expert_parallel: bool, device: torch.device,
               dtype: torch.dtype) -> HunyuanImage3Model:
    """Rank r's model, built empty (meta) and filled with its shards only: no rank holds the whole model."""
    config = HunyuanConfig.from_json(read_config(folder))
    check_split(config, world, expert_parallel)
    owned = block(config.num_experts, rank, world) if expert_parallel else slice(0, config.num_experts)
    inner = config.moe_intermediate_size if expert_parallel else config.moe_intermediate_size // world
    vocab = block(config.vocab_size, rank, world)
    with torch.device("meta"):
        model = HunyuanImage3Model(replace(config, num_heads=config.num_heads // world,
                                           num_kv_heads=config.num_kv_heads // world))
        model.model.wte = VocabShardEmbedding(vocab, config.hidden_size)
        for layer in model.model.layers:
            o_proj = layer.self_attn.o_proj
            layer.self_attn.o_proj = RowParallelLinear(o_proj.in_features, o_proj.out_features, bias=False)
            layer.mlp = RankMoE(config, world, range(owned.start, owned.stop), inner)
    model = model.to(dtype).to_empty(device=device)
    checkpoint = Checkpoint(folder)
    with torch.no_grad():  # one tensor at a time through the host: the rank's shard is all it ever holds
        for key, tensor in model.state_dict().items():
            part = shard(checkpoint, key, tensor.shape, config, rank, world, expert_parallel, owned.start, vocab)
            if part.shape != tensor.shape:
                raise ValueError(f"model weights: {key} has shape {tuple(part.shape)}, rank {rank} of {world} "
                                 f"expects {tuple(tensor.shape)}")
            tensor.copy_(part)
    return model.eval()


def rank_text_head(folder: Path, rank: int, world: int, device: torch.device,
                   dtype: torch.dtype) -> Optional[VocabShardHead]:
    """Rank r's text head (its `lm_head` rows), None when the folder has no text head."""
    checkpoint = Checkpoint(folder)
    if not all(key in checkpoint.where for key in HEAD_KEYS):
        return None
    config = HunyuanConfig.from_json(read_config(folder))
    rows = block(config.vocab_size, rank, world)
    head = VocabShardHead(rows, config.hidden_size, config.vocab_size, config.rms_norm_eps, world)
    head.load_state_dict({"lm_head.weight": checkpoint.read("lm_head.weight", rows),
                          "ln_f.weight": checkpoint.read("model.ln_f.weight")})
    return head.to(device=device, dtype=dtype).eval()


def shard(checkpoint: Checkpoint, key: str, shape: torch.Size, config: HunyuanConfig, rank: int, world: int,
          expert_parallel: bool, first_expert: int, vocab: slice) -> torch.Tensor:
    """Rank r's part of the checkpoint tensor behind its model's `key` (shape `shape`)."""
    parts = key.split(".")
    if key == "model.wte.weight":
        return checkpoint.read(key, vocab)
    if "experts" in parts:  # the rank's j-th expert is the checkpoint's first_expert + j
        at = parts.index("experts") + 1
        parts[at] = str(first_expert + int(parts[at]))
        key = ".".join(parts)
        if expert_parallel:
            return checkpoint.read(key)
    if key.endswith("self_attn.qkv_proj.weight"):
        rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        return checkpoint.read(key, block(rows, rank, world))
    if key.endswith(("o_proj.weight", "down_proj.weight")):  # row parallel: block r of the input columns
        return checkpoint.read(key, slice(None), block(shape[1] * world, rank, world))
    if key.endswith("gate_and_up_proj.weight"):  # [gate; up]: block r of each half
        half = shape[0] // 2 * world
        return torch.cat([checkpoint.read(key, block(half, rank, world)),
                          checkpoint.read(key, _shifted(block(half, rank, world), half))])
    return checkpoint.read(key)


def _shifted(rows: slice, by: int) -> slice:
    return slice(rows.start + by, rows.stop + by)


# -- the ranks ------------------------------------------------------------------------------------

class TensorParallelRank:
    """One rank's handler: its shard of the model and its heads' share of every prompt's KV cache, by key."""

    def __init__(self, model_path: str, dtype: torch.dtype, expert_parallel: bool, rank: int, world: int,
                 device: torch.device):
        self.rank = rank
        self.model = rank_model(Path(model_path), rank, world, expert_parallel, device, dtype)
        self.head = rank_text_head(Path(model_path), rank, world, device, dtype)
        self.caches: dict[str, KVCache] = {}
        self.residuals: dict[str, BranchCache] = {}  # the first-block cache of the row on the cache `key`
        self._rows: tuple = (None, None)  # (keys, grids) and their ImageRows: rebuilt when the batch changes

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def held_states(self) -> int:
        """Prompt KV caches held (a request with CFG holds two; one in its text phase, its text's)."""
        return len(self.caches)

    def report(self) -> dict[str, float]:
        """What the metrics read of this rank (worker_watch.py): the KV caches it holds."""
        return {"held_states": float(self.held_states())}

    def held_bytes(self, padded: bool = True) -> int:
        """The bytes of every KV cache shard and first-block cache residual this rank holds, and (`padded`) of the
        padded copies of the last forward's caches it keeps for the next one."""
        return held_bytes(self.caches, self.residuals, self._rows[1] if padded else None)

    @torch.inference_mode()
    def prefill(self, key: str, ids: torch.Tensor) -> None:
        self.caches[key] = self.model.prefill(ids)

    def _check_held(self, keys: tuple, device: torch.device) -> None:
        """The ranks agree that every rank holds the caches `keys` before a forward, so none is left waiting in a
        collective."""
        missing = [key for key in keys if key not in self.caches]
        ok = torch.tensor([0 if missing else 1], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if missing:
            raise KeyError(f"rank {self.rank} holds no KV cache {missing}")
        if not ok.item():
            raise RuntimeError("another rank lacks a KV cache of this forward")

    @torch.inference_mode()
    def text_logits(self, keys: tuple, lengths: tuple, token_ids: torch.Tensor) -> Optional[torch.Tensor]:
        """One text token per row (`token_ids` [R, 1]) after its cache `keys[r]`, taken at the `lengths[r]` the
        driver counts: each cache grows by its token's keys and values; the logits [R, vocab] (rank 0)."""
        self._check_held(keys, token_ids.device)
        caches = [self._trimmed(key, length) for key, length in zip(keys, lengths)]
        new, hidden = extend(self.model, caches, token_ids)
        for key, cache, kv in zip(keys, caches, new):
            self.caches[key] = grow(cache, kv)
        logits = self.head(hidden)
        return logits if self.rank == 0 else None

    def _trimmed(self, key: str, length: int) -> KVCache:
        cache = self.caches[key]
        if cache.length == length:
            return cache
        return KVCache([k[:, :length] for k in cache.keys], [v[:, :length] for v in cache.values])

    @torch.inference_mode()
    def predict(self, keys: tuple, grids: tuple, latents: list, timesteps: torch.Tensor,
                thresholds: Optional[tuple] = None) -> Optional[tuple]:
        """Each row's prediction (rank 0) for the rows of the caches `keys`. With `thresholds` (one per row, None
        where the row does not cache) the first-block cache decides per row; rank 0 also returns each caching
        row's decision ("computed" or "reused"; None for the others)."""
        self._check_held(keys, timesteps.device)
        if self._rows[0] != (keys, grids):
            self._rows = ((keys, grids), self.model.image_rows([self.caches[key] for key in keys], list(grids)))
        groups = None if thresholds is None else self._groups(keys, thresholds)
        out = self.model.predict(self._rows[1], latents, timesteps, groups)
        decisions = None if groups is None else [next(iter(g.tally)) if g.tally else None for g in groups]
        return (out, decisions) if self.rank == 0 else None

    def _groups(self, keys: tuple, thresholds: tuple) -> list[RowGroup]:
        """One first-block cache group per row, each caching one with its residuals and a tally of its decision."""
        counts = self._rows[1].counts
        return [RowGroup(slice(r, r + 1), None, None, counts[r]) if threshold is None else
                RowGroup(slice(r, r + 1), threshold, self.residuals.setdefault(key, BranchCache()), counts[r], Counter())
                for r, (key, threshold) in enumerate(zip(keys, thresholds))]

    def free(self, keys: list) -> None:
        for key in keys:
            self.caches.pop(key, None)
            self.residuals.pop(key, None)
        if self._rows[0] is not None and set(keys) & set(self._rows[0][0]):
            self._rows = (None, None)


def _load_rank(model_path: str, dtype: torch.dtype, expert_parallel: bool, rank: int, world: int,
               device: torch.device) -> TensorParallelRank:
    return TensorParallelRank(model_path, dtype, expert_parallel, rank, world, device)


# -- the driver -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class RemoteCache:
    """A prompt's KV cache held on the ranks (each its heads' share), by key."""

    key: str
    length: int


@dataclass(frozen=True)
class RemoteRows:
    """A forward's rows, by their caches' keys and image grids (the ranks build and keep the padded caches)."""

    keys: tuple
    grids: tuple


class RankedModel:
    """The driver's transformer: `prefill`, `image_rows`, `predict` and `free` as `HunyuanImage3Model` has them, and
    a think's `text_logits`, run on the ranks (`workers`, set by `start`)."""

    def __init__(self, config: HunyuanConfig):
        self.config = config
        self.workers: Optional[WorkerGroup] = None
        self._keys = itertools.count()

    def to(self, *args, **kwargs) -> "RankedModel":
        return self  # the ranks' devices are theirs

    def eval(self) -> "RankedModel":
        return self

    def _all(self, method: str, *args):
        return self.workers.call(method, [args] * self.workers.world_size)

    def prefill(self, token_ids: torch.Tensor) -> RemoteCache:
        key = f"kv{next(self._keys)}"
        self._all("prefill", key, token_ids)
        return RemoteCache(key, len(token_ids))

    def image_rows(self, caches: list[RemoteCache], grids: list[tuple[int, int]]) -> RemoteRows:
        return RemoteRows(tuple(cache.key for cache in caches), tuple(grids))

    def predict(self, rows: RemoteRows, latents: list[torch.Tensor], timesteps: torch.Tensor,
                groups: Optional[list] = None) -> list[torch.Tensor]:
        """With `groups` (one per row: `HunyuanImage3Adapter._row_groups`) the ranks decide with their residuals;
        the decisions are counted in each group's tally here."""
        thresholds = None if groups is None else tuple(g.threshold for g in groups)
        preds, decisions = self._all("predict", rows.keys, rows.grids, list(latents), timesteps, thresholds)
        for group, decision in zip(groups or [], decisions or []):
            if group.tally is not None and decision is not None:
                group.tally[decision] += 1
        return [pred.to(timesteps.device) for pred in preds]

    def text_logits(self, caches: list[RemoteCache], token_ids: torch.Tensor) -> torch.Tensor:
        """`TensorParallelRank.text_logits` on every rank: the logits [R, vocab] on the host."""
        return self._all("text_logits", tuple(c.key for c in caches), tuple(c.length for c in caches), token_ids)

    def free(self, caches: list[RemoteCache]) -> None:
        """Drop these caches on every rank (a broken group's ranks are gone, and their caches with them)."""
        if caches and self.workers is not None and not self.workers.broken:
            try:
                self._all("free", [cache.key for cache in caches])
            except WorkerError as error:  # the group is broken now: the engine restarts it
                logger.warning("freeing KV caches on the ranks failed: %s", error)


class RankedTextHead:
    """The ranks' text head, as `think.TextHead` is called: a token's forward grows the caches on the ranks."""

    def logits(self, model: RankedModel, caches: list[RemoteCache],
               token_ids: torch.Tensor) -> tuple[torch.Tensor, None]:
        return model.text_logits(caches, token_ids), None

    @staticmethod
    def grown(cache: RemoteCache, new: None) -> RemoteCache:
        return replace(cache, length=cache.length + 1)


def ranked_model(model_path: str) -> RankedModel:
    return RankedModel(HunyuanConfig.from_json(read_config(Path(model_path))))


def ranked_text_head(model_path: str) -> Optional[RankedTextHead]:
    """The ranks' text head, None when the folder has none (each rank loads its rows: `rank_text_head`)."""
    where = Checkpoint(Path(model_path)).where
    return RankedTextHead() if all(key in where for key in HEAD_KEYS) else None


def start(model: RankedModel, model_path: str, device: torch.device, dtype: torch.dtype, config: EngineConfig,
          timeout_s: float = DEFAULT_TIMEOUT_S) -> WorkerGroup:
    """`tensor_parallel_size` workers, each loading its shard on its device; `model` hands its calls to them."""
    parallel = config.parallel
    world = parallel.tensor_parallel_size
    check_split(model.config, world, parallel.expert_parallel)
    setup = functools.partial(_load_rank, model_path, dtype, parallel.expert_parallel)
    model.workers = WorkerGroup(setup, rank_devices(device, world, parallel.device_list()), timeout_s)
    return model.workers
