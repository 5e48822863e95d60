"""HunyuanImage-3.0's text-to-image model, our own code, written from the published architecture
(Tencent-Hunyuan/HunyuanImage-3.0).

Neither diffusers nor transformers has it. What the generation path needs:

* the decoder-only MoE transformer: attention with one fused `qkv_proj` (grouped
  per KV head), 2D RoPE then q/k RMSNorm, and in every layer a mixture of experts
  (softmax top-k routing with normalised weights) plus a shared MLP (SwiGLU);
* the image tokens' way in and out: `patch_embed` (a conv and a timestep-conditioned
  ResBlock, one token per latent pixel), `final_layer` (a ResBlock and a conv back to
  the latent channels), three timestep embedders (`time_embed` conditions the way in,
  `time_embed_2` the way out, `timestep_emb` is the `<timestep>` token);
* `prefill`: the text part of a request's sequence (causal) into its own KV cache;
* `predict`: every row's `<timestep>` + image tokens in one forward against its own
  cache (causal for the `<timestep>` token, bidirectional inside the image block),
  caches and images of different sizes padded and masked.

Module names are the checkpoint's, so `state_dict()` keys are the official ones.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine_lib.host_copy import to_device
from engine_lib.pipelines.checkpoint import check_keys, group_indices
from engine_lib.pipelines.decoder_parts import (KVCache, PaddedCaches, RMSNorm, apply_rope, attend, first_layer_cache,
                                                 timestep_embedding)

logger = logging.getLogger(__name__)

# Understanding-only parts of the official checkpoint: the ViT and its aligner, the VAE encoder (image
# conditioning), the text head and its final norm (text generation).
UNDERSTANDING_PREFIXES = ("vision_model.", "vision_aligner.", "vae.encoder.", "lm_head.", "model.ln_f.")


@dataclass(frozen=True)
class HunyuanConfig:
    """The fields of the official `config.json` the generation path reads."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    num_experts: int
    moe_topk: int
    moe_intermediate_size: int
    num_shared_expert: int
    latent_channels: int
    patch_embed_hidden_dim: int
    vae_downsample: int
    image_base_size: int
    vae: dict

    @classmethod
    def from_json(cls, config: dict) -> "HunyuanConfig":
        for key, expected in (("hidden_act", "silu"), ("img_proj_type", "unet"), ("patch_size", 1),
                              ("use_qk_norm", True), ("use_mixed_mlp_moe", True), ("norm_topk_prob", True),
                              ("moe_layer_num_skipped", 0), ("group_limited_greedy", False)):
            if config.get(key, expected) != expected:
                raise ValueError(f"config.json: {key}={config[key]!r} is not supported (only {expected!r})")
        return cls(hidden_size=config["hidden_size"], num_layers=config["num_hidden_layers"],
                   num_heads=config["num_attention_heads"], num_kv_heads=config["num_key_value_heads"],
                   head_dim=config["attention_head_dim"], vocab_size=config["vocab_size"],
                   rms_norm_eps=config["rms_norm_eps"], rope_theta=config["rope_theta"],
                   num_experts=config["num_experts"], moe_topk=config["moe_topk"],
                   moe_intermediate_size=config["moe_intermediate_size"],
                   num_shared_expert=config["num_shared_expert"], latent_channels=config["vae"]["latent_channels"],
                   patch_embed_hidden_dim=config["patch_embed_hidden_dim"],
                   vae_downsample=config["vae_downsample_factor"][0], image_base_size=config["image_base_size"],
                   vae=dict(config["vae"]))


# -- the transformer ------------------------------------------------------------------------

class SwiGLU(nn.Module):
    """Hunyuan's MLP: one `gate_and_up_proj`, `down_proj(x1 * silu(x2))`."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_and_up_proj = nn.Linear(hidden, 2 * inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = self.gate_and_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(x1 * F.silu(x2))


class Gate(nn.Module):
    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.wg = nn.Linear(hidden, experts, bias=False)


class MoE(nn.Module):
    """A shared MLP plus top-k routed experts, weights renormalised over the chosen k (tokens [T, D]).

    The routed experts run as two grouped matmuls over the tokens sorted by expert (`F.grouped_mm`, its
    group ends computed on the device), not as one call per expert on the tokens `nonzero` finds: on
    CUDA that read every expert's token count back to the host, E waits per layer; torch's grouped
    kernel (bf16, sm90+) needs none, its fallback one per call. Each expert's weights stay under the
    checkpoint's names as views into one stacked [E, out, in] tensor per projection (`_stack_experts`).
    """

    def __init__(self, c: HunyuanConfig):
        super().__init__()
        self.topk = c.moe_topk
        self.shared_mlp = SwiGLU(c.hidden_size, c.moe_intermediate_size * c.num_shared_expert)
        self.gate = Gate(c.hidden_size, c.num_experts)
        self.experts = nn.ModuleList(SwiGLU(c.hidden_size, c.moe_intermediate_size) for _ in range(c.num_experts))
        self._stack_experts()

    def _stack_experts(self) -> None:
        """Make every expert's `gate_and_up_proj` and `down_proj` weight a view into one stacked tensor, so
        the grouped matmul reads them without a copy and `load_state_dict` (in place) fills both."""
        self.stacked = {}
        for name in ("gate_and_up_proj", "down_proj"):
            linears = [getattr(expert, name) for expert in self.experts]
            stacked = torch.stack([linear.weight.detach() for linear in linears])
            for e, linear in enumerate(linears):
                linear.weight.data = stacked[e]
            self.stacked[name] = stacked

    def _apply(self, fn, recurse=True):
        """`.to()`, `.half()`, ... give each parameter its own storage: stack them again."""
        super()._apply(fn, recurse)
        self._stack_experts()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = F.softmax(F.linear(x.float(), self.gate.wg.weight.float()), dim=-1)  # the router runs in float32
        weight, chosen = torch.topk(gates, self.topk)
        weight = weight / weight.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(gates.dtype).eps)
        # each token's experts in ascending order: the order its expert outputs are summed in
        chosen, by_expert = chosen.sort(dim=-1)
        weight = weight.gather(-1, by_expert)
        T, k = chosen.shape
        flat = chosen.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert, tokens ascending in each
        counts = torch.zeros(len(self.experts), dtype=torch.long, device=x.device).scatter_add_(0, flat,
                                                                                              torch.ones_like(flat))
        ends = counts.cumsum(0).to(torch.int32)
        gate_and_up = F.grouped_mm(x[order // k], self.stacked["gate_and_up_proj"].transpose(1, 2), offs=ends)
        x1, x2 = gate_and_up.chunk(2, dim=-1)
        routed = F.grouped_mm(x1 * F.silu(x2), self.stacked["down_proj"].transpose(1, 2), offs=ends)
        routed = routed * weight.flatten()[order, None].to(x.dtype)
        slots = torch.empty_like(routed).index_copy_(0, order, routed).view(T, k, -1)  # back to (token, slot)
        out = torch.zeros_like(x)
        for slot in range(k):
            out = out + slots[:, slot]
        return self.shared_mlp(x) + out


class Attention(nn.Module):
    def __init__(self, c: HunyuanConfig):
        super().__init__()
        self.c = c
        self.qkv_proj = nn.Linear(c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.query_layernorm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.key_layernorm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, D] -> q [B, heads, T, d], k, v [B, kv_heads, T, d]: RoPE, then q/k RMSNorm (the reference's order)."""
        c = self.c
        B, T, _ = x.shape
        groups = c.num_heads // c.num_kv_heads
        qkv = self.qkv_proj(x).view(B, T, c.num_kv_heads, groups + 2, c.head_dim)
        q, k, v = qkv.split([groups, 1, 1], dim=3)
        q = q.reshape(B, T, c.num_heads, c.head_dim).transpose(1, 2)
        k = k.reshape(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = v.reshape(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos[:, None], sin[:, None]), apply_rope(k, cos[:, None], sin[:, None])
        return self.query_layernorm(q), self.key_layernorm(k), v


class Layer(nn.Module):
    def __init__(self, c: HunyuanConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MoE(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def feed_forward(self, hidden: torch.Tensor, tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The MoE on the real tokens only (`tokens`: their flat indices into [B * T], ascending; None: all),
        residual added."""
        flat = hidden.flatten(0, 1)
        if tokens is None:
            return hidden + self.mlp(self.post_attention_layernorm(flat)).view_as(hidden)
        routed = self.mlp(self.post_attention_layernorm(flat.index_select(0, tokens)))
        return hidden + torch.zeros_like(flat).index_copy_(0, tokens, routed).view_as(hidden)


class Decoder(nn.Module):
    def __init__(self, c: HunyuanConfig):
        super().__init__()
        self.wte = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_layers))


# -- the image tokens' way in and out (the reference's UNetDown / UNetUp, patch size 1) -------------

class ResBlock(nn.Module):
    """GroupNorm-SiLU-conv, adaptive GroupNorm by the timestep embedding (scale, shift), SiLU-conv, skip."""

    def __init__(self, cin: int, emb: int, cout: int):
        super().__init__()
        self.in_layers = nn.Sequential(nn.GroupNorm(32, cin), nn.SiLU(), nn.Conv2d(cin, cout, 3, padding=1))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb, 2 * cout))
        self.out_layers = nn.Sequential(nn.GroupNorm(32, cout), nn.SiLU(), nn.Dropout(0.0),
                                        nn.Conv2d(cout, cout, 3, padding=1))
        self.skip_connection = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.in_layers(x)
        scale, shift = self.emb_layers(emb)[..., None, None].chunk(2, dim=1)
        h = self.out_layers[0](h) * (1.0 + scale) + shift
        return self.skip_connection(x) + self.out_layers[1:](h)


class PatchEmbed(nn.Module):
    def __init__(self, c: HunyuanConfig):
        super().__init__()
        self.model = nn.ModuleList([nn.Conv2d(c.latent_channels, c.patch_embed_hidden_dim, 3, padding=1),
                                    ResBlock(c.patch_embed_hidden_dim, c.hidden_size, c.hidden_size)])

    def forward(self, latents: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] -> tokens [B, h * w, D], row-major."""
        x = self.model[1](self.model[0](latents), emb)
        return x.flatten(2).transpose(1, 2)


class FinalLayer(nn.Module):
    def __init__(self, c: HunyuanConfig):
        super().__init__()
        hidden = c.patch_embed_hidden_dim
        self.model = nn.ModuleList([ResBlock(c.hidden_size, c.hidden_size, hidden),
                                    nn.Sequential(nn.GroupNorm(32, hidden), nn.SiLU(),
                                                  nn.Conv2d(hidden, c.latent_channels, 3, padding=1))])

    def forward(self, tokens: torch.Tensor, emb: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Image-token hidden states [B, h * w, D] -> the prediction [B, C, h, w]."""
        x = tokens.transpose(1, 2).reshape(tokens.shape[0], -1, *grid)
        return self.model[1](self.model[0](x, emb))


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(frequency_embedding_size, hidden), nn.GELU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(timestep_embedding(t, self.mlp[0].in_features).to(self.mlp[0].weight.dtype))


# -- positions ------------------------------------------------------------------------------------

def rope_2d(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's 2D RoPE: positions [..., 2] as (y, x) -> cos, sin [..., head_dim]; y takes the even
    frequencies, x the odd ones, and the halves repeat (rotate-half layout)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    angles = (positions[..., None, :].float() * inv.reshape(head_dim // 4, 2)).flatten(-2)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def image_positions(start: int, grid: tuple[int, int]) -> torch.Tensor:
    """(y, x) of an image block whose first token sits at `start`: centred in an h*w by h*w square, truncated
    to integers as the reference's meshgrid of `linspace(beta, beta + n, n + 1)[:n]` is."""
    h, w = grid
    beta_y, beta_x = start + (w * h - h) / 2, start + (w * h - w) / 2
    ys = torch.linspace(beta_y, beta_y + h, h + 1, dtype=torch.float32)[:h]
    xs = torch.linspace(beta_x, beta_x + w, w + 1, dtype=torch.float32)[:w]
    grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
    return torch.stack([grid_y.flatten(), grid_x.flatten()], dim=1).long()


def text_positions(start: int, stop: int) -> torch.Tensor:
    p = torch.arange(start, stop)
    return torch.stack([p, p], dim=1)


# -- the model ----------------------------------------------------------------------------------

class HunyuanImage3Model(nn.Module):
    """The generation part of `HunyuanImage3ForCausalMM`, under its key names (the VAE decoder is separate)."""

    def __init__(self, c: HunyuanConfig):
        super().__init__()
        self.config = c
        self.model = Decoder(c)
        self.patch_embed = PatchEmbed(c)
        self.final_layer = FinalLayer(c)
        self.time_embed = TimestepEmbedder(c.hidden_size)
        self.time_embed_2 = TimestepEmbedder(c.hidden_size)
        self.timestep_emb = TimestepEmbedder(c.hidden_size)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_2d(positions.to(self.model.wte.weight.device), self.config.head_dim, self.config.rope_theta)
        dtype = self.model.wte.weight.dtype
        return cos.to(dtype), sin.to(dtype)

    @torch.no_grad()
    def prefill(self, token_ids: torch.Tensor) -> KVCache:
        """The text part of a sequence (causal, positions (p, p)) into a KV cache."""
        hidden = self.model.wte(token_ids)[None]  # [1, L, D]
        L = len(token_ids)
        cos, sin = self.rope(text_positions(0, L)[None])
        causal = torch.ones(L, L, dtype=torch.bool, device=hidden.device).tril()
        keys, values = [], []
        for layer in self.model.layers:
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(hidden), cos, sin)
            keys.append(k[0])
            values.append(v[0])
            out = attend(q, k, v, causal).transpose(1, 2).reshape(1, L, -1)
            hidden = hidden + layer.self_attn.o_proj(out)
            hidden = layer.feed_forward(hidden)
        return KVCache(keys, values)

    def image_rows(self, caches: list[KVCache], grids: list[tuple[int, int]]) -> "ImageRows":
        return ImageRows.build(self, caches, grids)

    def free(self, caches: list[KVCache]) -> None:
        """Nothing to do: in one process a cache goes with its last reference (tensor parallel ranks drop theirs)."""

    @torch.no_grad()
    def predict(self, rows: "ImageRows", latents: list[torch.Tensor], timesteps: torch.Tensor,
                groups: Optional[list] = None) -> list[torch.Tensor]:
        """One forward over `rows` (r: `<timestep>`, then the h_r x w_r image tokens of `latents[r]` [C, h, w]) at
        timestep `timesteps[r]` (sigma * 1000), each against its own cache: the prediction [C, h, w] per row.
        With `groups` (step_cache.RowGroup, one per row and its own image tokens), the first-block cache decides
        per group after the first layer (`decoder_parts.first_layer_cache`)."""
        c = self.config
        R, Q = len(latents), rows.num_queries
        hidden = torch.zeros(R, Q, c.hidden_size, device=timesteps.device, dtype=self.model.wte.weight.dtype)
        hidden[:, 0] = self.timestep_emb(timesteps)
        for (h, w), members, index in rows.groups:
            x = torch.stack([latents[r] for r in members]).to(hidden.dtype)
            hidden[index, 1:1 + h * w] = self.patch_embed(x, self.time_embed(timesteps[index]))
        if groups is None:
            hidden = self.run_layers(hidden, rows, range(c.num_layers))
        else:
            hidden = first_layer_cache(self.run_layers, hidden, rows, groups, c.num_layers)
        out: list[torch.Tensor] = [None] * R  # type: ignore[list-item]
        for grid, members, index in rows.groups:
            tokens = hidden[index, 1:1 + grid[0] * grid[1]]
            pred = self.final_layer(tokens, self.time_embed_2(timesteps[index]), grid).float()
            for k, r in enumerate(members):
                out[r] = pred[k]
        return out

    def run_layers(self, hidden: torch.Tensor, rows: "ImageRows", layers: range) -> torch.Tensor:
        """`hidden` [R, Q, D] of `rows` through the decoder layers `layers`, each row against its own cache."""
        R, Q = hidden.shape[:2]
        padded = rows.caches
        for i in layers:
            layer = self.model.layers[i]
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(hidden), rows.cos, rows.sin)
            out = attend(q, torch.cat([padded.keys[i], k], dim=2), torch.cat([padded.values[i], v], dim=2), rows.mask)
            hidden = hidden + layer.self_attn.o_proj(out.transpose(1, 2).reshape(R, Q, -1))
            hidden = layer.feed_forward(hidden, rows.tokens)
        return hidden

    # -- the official layout ------------------------------------------------------------------
    def load_official(self, state: dict[str, torch.Tensor], vae) -> None:
        """Copy every expected key (this model's and the VAE decoder's); a missing, extra or misshapen one fails
        naming it. Understanding-only parts are skipped with one log line."""
        expected = {**self.state_dict(), **{f"vae.decoder.{k}": v for k, v in vae.decoder.state_dict().items()}}
        check_keys("model weights", state, {k: t.shape for k, t in expected.items()}, UNDERSTANDING_PREFIXES, logger)
        self.load_state_dict({k: state[k] for k in self.state_dict()}, strict=True)
        vae.decoder.load_state_dict({k: state[f"vae.decoder.{k}"] for k in vae.decoder.state_dict()}, strict=True)


@dataclass
class ImageRows:
    """What a forward's rows need besides their latents and timesteps, made once per batch membership
    (the adapter keeps it with the batch) and without a host wait: indices and positions are made on
    the host and copied by `to_device`.

    Row r is `<timestep>` then its h_r * w_r image tokens, right-padded to Q = 1 + the most; it attends
    to its own cache (padded to the longest) and to its own query tokens.
    """

    caches: PaddedCaches
    num_queries: int  # Q
    tokens: torch.Tensor  # flat indices (r * Q + q) of the real query tokens, ascending: the MoE's tokens
    mask: torch.Tensor  # [R, 1, Q, C_max + Q] bool: the keys each query attends to
    cos: torch.Tensor  # [R, Q, head_dim]: 2D RoPE of every query position
    sin: torch.Tensor
    groups: list  # (grid, [row], row indices on the device) per image size
    counts: tuple = ()  # on the host: each row's image tokens

    def take(self, taken: list[int]) -> "ImageRows":
        """Rows `taken` (host ints) of these, with their caches, for the layers alone (no `groups`): the rows that
        compute a cached step's later layers."""
        index = to_device(taken, self.mask.device)
        pick = lambda x: x.index_select(0, index)  # noqa: E731
        counts = [self.counts[r] for r in taken]
        Q = self.num_queries
        caches = PaddedCaches([pick(k) for k in self.caches.keys], [pick(v) for v in self.caches.values],
                              pick(self.caches.valid))
        tokens = to_device([r * Q + q for r, n in enumerate(counts) for q in range(n + 1)], index.device)
        return ImageRows(caches, Q, tokens, pick(self.mask), pick(self.cos), pick(self.sin), [], tuple(counts))

    @classmethod
    def build(cls, model: "HunyuanImage3Model", caches: list[KVCache], grids: list[tuple[int, int]]) -> "ImageRows":
        device = model.model.wte.weight.device
        counts = [h * w for h, w in grids]
        R, Q = len(caches), 1 + max(counts)
        padded = PaddedCaches.of(caches)
        index = torch.arange(Q, device=device)
        query = index[None] <= to_device(counts, device)[:, None]  # [R, Q] real
        # <timestep> sees the prompt and itself; image tokens see the prompt, <timestep> and every image token.
        within = query[:, None, :] & ((index[:, None] > 0) | (index[None, :] == 0))[None]
        mask = torch.cat([padded.valid[:, None, :].expand(R, Q, -1), within], dim=2)[:, None]
        positions = torch.zeros(R, Q, 2, dtype=torch.long)  # on the host
        for r, (cache, grid) in enumerate(zip(caches, grids)):
            start = cache.length
            positions[r, :1 + counts[r]] = torch.cat([text_positions(start, start + 1), image_positions(start + 1, grid)])
        cos, sin = model.rope(to_device(positions, device))
        tokens = to_device([r * Q + q for r, n in enumerate(counts) for q in range(n + 1)], device)
        groups = [(grid, members, to_device(members, device)) for grid, members in group_indices(grids).items()]
        return cls(padded, Q, tokens, mask, cos, sin, groups, tuple(counts))


def read_config(model_path: Path) -> dict:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing (a HunyuanImage-3.0 folder holds config.json, the safetensors "
                                "shards and the tokenizer files)")
    return json.loads(path.read_text())


def read_weights(model_path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors shards (`model.safetensors.index.json` names them when present);
    with `prefix`, only those under it (their keys without it), the others left unread."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else sorted(p.name for p in folder.glob("*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {folder}")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        if not prefix:
            state.update(load_file(str(folder / name)))
            continue
        with safe_open(str(folder / name), framework="pt") as f:
            state.update({key[len(prefix):]: f.get_tensor(key) for key in f.keys() if key.startswith(prefix)})
    return state


