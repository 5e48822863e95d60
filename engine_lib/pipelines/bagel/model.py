"""BAGEL's text-to-image model, our own code, written from the published architecture (ByteDance-Seed/Bagel).

Neither diffusers nor transformers has BAGEL, so this module holds what the
generation path needs and nothing else:

* a Qwen2 decoder whose layers carry a second ("generation", `*_moe_gen`) copy of
  the attention projections, q/k norms, MLP and layer norms, used for image-latent
  tokens (mixture of transformers); text tokens (the prompt, `<|vision_start|>`,
  `<|vision_end|>`) use the understanding weights;
* `extend`: text tokens appended to each row's KV cache (understanding weights, causal,
  RoPE positions continuing the cache's): a prompt's prefill, or one decoded token per
  row for many requests at once, whose last hidden state `lm_head` turns into logits;
* `velocity`: the latent tokens of many rows in one forward, each row attending to
  its own cache (caches of different lengths padded and masked) plus its own
  query block (non-causal), all query tokens of a row at one RoPE position;
* the timestep embedder, `vae2llm` / `llm2vae` and the latent position table.

Weights load from the official layout (`llm_config.json`, `ema.safetensors`):
every key is consumed or, for understanding-only parts, skipped by name; anything
else fails the load naming the key. The VAE is diffusers' `AutoencoderKL` loaded
from the FLUX `ae.safetensors` layout (see vae.py).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine_lib.host_copy import to_device
from engine_lib.pipelines.checkpoint import check_keys
from engine_lib.pipelines.decoder_parts import (KVCache, PaddedCaches, RMSNorm, apply_rope, attend, first_layer_cache,
                                                 grow, timestep_embedding)

logger = logging.getLogger(__name__)

# Image-understanding weights of the official checkpoint: the ViT, its connector and position table (image inputs
# are not served, so they stay unloaded).
UNDERSTANDING_PREFIXES = ("vit_model.", "connector.", "vit_pos_embed.")



@dataclass(frozen=True)
class BagelConfig:
    """The LLM fields of `llm_config.json` plus what the weights' shapes say (the official app sets
    qk_norm and the MoT layers itself; max_latent_size and the patch size follow from the tables)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_latent_size: int = 64  # latent patches per side (the position table is max_latent_size ** 2 rows)
    patch_latent_dim: int = 64  # latent_channels * patch ** 2
    frequency_embedding_size: int = 256

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_llm_config(cls, llm_config: dict, **shapes) -> "BagelConfig":
        return cls(hidden_size=llm_config["hidden_size"], num_layers=llm_config["num_hidden_layers"],
                   num_heads=llm_config["num_attention_heads"], num_kv_heads=llm_config["num_key_value_heads"],
                   intermediate_size=llm_config["intermediate_size"], vocab_size=llm_config["vocab_size"],
                   rms_norm_eps=llm_config["rms_norm_eps"], rope_theta=llm_config["rope_theta"], **shapes)


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Expert(nn.Module):
    """One set of a layer's weights: the understanding copy or the generation (`_moe_gen`) copy."""

    def __init__(self, c: BagelConfig):
        super().__init__()
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)

    def qkv(self, x: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
        """Normalised input -> q [T, heads, d], k, v [T, kv_heads, d], q and k RMS-normed per head."""
        q = self.q_norm(self.q_proj(x).view(-1, heads, head_dim))
        k = self.k_norm(self.k_proj(x).view(-1, kv_heads, head_dim))
        return q, k, self.v_proj(x).view(-1, kv_heads, head_dim)


class MoTLayer(nn.Module):
    """A decoder layer holding both experts, under the official key names (`self_attn.q_proj`,
    `self_attn.q_proj_moe_gen`, `mlp_moe_gen`, `input_layernorm_moe_gen`, ...)."""

    def __init__(self, c: BagelConfig):
        super().__init__()
        self.und, self.gen = Expert(c), Expert(c)

    # The official names, so state_dict() keys are the checkpoint's.
    def _official_names(self) -> dict[str, str]:
        names = {}
        for expert, suffix in ((self.und, ""), (self.gen, "_moe_gen")):
            for part in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                names[f"self_attn.{part}{suffix}"] = getattr(expert, part)
            for part in ("input_layernorm", "post_attention_layernorm", "mlp"):
                names[f"{part}{suffix}"] = getattr(expert, part)
        return names


def rope(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2's default RoPE: cos, sin [..., head_dim] of integer positions."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
                                / head_dim))
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


class BagelModel(nn.Module):
    """The MoT language model plus the generation heads, with the checkpoint's key names."""

    def __init__(self, c: BagelConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(MoTLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm_moe_gen = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.time_embedder = nn.Sequential(nn.Linear(c.frequency_embedding_size, c.hidden_size), nn.SiLU(),
                                           nn.Linear(c.hidden_size, c.hidden_size))
        self.vae2llm = nn.Linear(c.patch_latent_dim, c.hidden_size)
        self.llm2vae = nn.Linear(c.hidden_size, c.patch_latent_dim)
        self.latent_pos_embed = nn.Parameter(torch.zeros(c.max_latent_size ** 2, c.hidden_size), requires_grad=False)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    # -- the official layout ------------------------------------------------------------
    def official_parameters(self) -> dict[str, torch.Tensor]:
        """Checkpoint key -> this model's tensor (the keys of `ema.safetensors` the generation path uses)."""
        lm = "language_model.model."
        named = {f"{lm}embed_tokens.weight": self.embed_tokens.weight, f"{lm}norm.weight": self.norm.weight,
                 f"{lm}norm_moe_gen.weight": self.norm_moe_gen.weight,
                 "latent_pos_embed.pos_embed": self.latent_pos_embed, "language_model.lm_head.weight": self.lm_head.weight}
        for i, layer in enumerate(self.layers):
            for name, module in layer._official_names().items():
                for leaf, tensor in module.named_parameters():
                    named[f"{lm}layers.{i}.{name}.{leaf}"] = tensor
        for prefix, module in (("time_embedder.mlp.", self.time_embedder), ("vae2llm.", self.vae2llm),
                               ("llm2vae.", self.llm2vae)):
            for leaf, tensor in module.named_parameters():
                named[prefix + leaf] = tensor
        return named

    def load_official(self, state: dict[str, torch.Tensor]) -> None:
        """Copy every expected key; a missing, extra or misshapen one fails naming it."""
        expected = self.official_parameters()
        check_keys("ema.safetensors", state, {k: t.shape for k, t in expected.items()}, UNDERSTANDING_PREFIXES,
                   logger)
        with torch.no_grad():
            for key, tensor in expected.items():
                tensor.copy_(state[key])

    # -- text into each row's own cache ------------------------------------------------
    def empty_cache(self) -> KVCache:
        c, p = self.config, self.embed_tokens.weight
        empty = lambda: p.new_zeros(c.num_kv_heads, 0, c.head_dim)  # noqa: E731
        return KVCache([empty() for _ in self.layers], [empty() for _ in self.layers])

    @torch.no_grad()
    def prefill(self, token_ids: torch.Tensor) -> KVCache:
        """The (wrapped) prompt into a fresh cache, from position 0."""
        cache = self.empty_cache()
        return grow(cache, self.extend([cache], token_ids[None])[0][0])

    @torch.no_grad()
    def extend(self, caches: list[KVCache], token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`token_ids` [R, L] run after row r's context `caches[r]` through the understanding weights, causally,
        at RoPE positions continuing that cache (caches of different lengths padded and masked); changes no cache.
        Returns the tokens' keys and values [R, layers, 2, kv_heads, L, d] (`grow` appends them) and each row's
        last hidden state after the final `norm` [R, D] (what `lm_head` reads)."""
        c = self.config
        R, L = token_ids.shape
        hidden = self.embed_tokens(token_ids).view(R * L, -1)
        padded = PaddedCaches.of(caches)
        lengths = to_device([cache.length for cache in caches], hidden.device)
        cos, sin = rope(lengths[:, None] + torch.arange(L, device=hidden.device), c.head_dim, c.rope_theta)
        cos, sin = cos[:, None].to(hidden.dtype), sin[:, None].to(hidden.dtype)  # [R, 1, L, d]
        causal = torch.ones(L, L, dtype=torch.bool, device=hidden.device).tril()
        mask = torch.cat([padded.valid[:, None].expand(R, L, -1), causal.expand(R, L, L)], dim=2)[:, None]
        new_keys, new_values = [], []
        for i, layer in enumerate(self.layers):
            und = layer.und
            q, k, v = und.qkv(und.input_layernorm(hidden), c.num_heads, c.num_kv_heads, c.head_dim)
            q = apply_rope(q.view(R, L, c.num_heads, c.head_dim).transpose(1, 2), cos, sin)
            k = apply_rope(k.view(R, L, c.num_kv_heads, c.head_dim).transpose(1, 2), cos, sin)
            v = v.view(R, L, c.num_kv_heads, c.head_dim).transpose(1, 2)
            new_keys.append(k)
            new_values.append(v)
            out = attend(q, torch.cat([padded.keys[i], k], dim=2), torch.cat([padded.values[i], v], dim=2), mask)
            hidden = hidden + und.o_proj(out.transpose(1, 2).reshape(R * L, -1))
            hidden = hidden + und.mlp(und.post_attention_layernorm(hidden))
        new = torch.stack([torch.stack(new_keys, 1), torch.stack(new_values, 1)], 2)
        return new, self.norm(hidden.view(R, L, -1)[:, -1])

    # -- one denoise forward over many rows ----------------------------------------------
    @torch.no_grad()
    def velocity(self, rows: "QueryRows", latents: torch.Tensor, timesteps: torch.Tensor,
                 groups: Optional[list] = None) -> torch.Tensor:
        """The raw velocity (llm2vae) of every row's latent tokens: [R, N_max, patch_latent_dim].

        `latents` [R, N_max, patch_latent_dim] (rows right-padded), `timesteps` [R]. With `groups`
        (step_cache.RowGroup, one per row and its request's own latent tokens), the first-block cache decides
        per group after the first layer (`decoder_parts.first_layer_cache`).
        """
        c = self.config
        R, Q = rows.valid.shape
        dtype = self.embed_tokens.weight.dtype
        hidden = torch.zeros(R, Q, c.hidden_size, device=latents.device, dtype=dtype)
        time = self.time_embedder(timestep_embedding(timesteps, c.frequency_embedding_size).to(dtype))
        tokens = self.vae2llm(latents.to(dtype)) + time[:, None] + self.latent_pos_embed[rows.latent_pos]
        hidden[:, 1:1 + latents.shape[1]] = tokens * rows.valid[:, 2:, None]  # padding stays zero
        text = self.embed_tokens(rows.text_ids)  # [R, 2]: <|vision_start|>, <|vision_end|>
        hidden[:, 0] = text[:, 0]
        hidden[rows.arange, rows.end] = text[:, 1]
        hidden = hidden.view(R * Q, -1)
        if groups is None:
            hidden = self.run_layers(hidden, rows, range(c.num_layers))
        else:
            hidden = first_layer_cache(lambda x, rows, layers: self.run_layers(x.flatten(0, 1), rows, layers).view(
                x.shape), hidden.view(R, Q, -1), rows, groups, c.num_layers).flatten(0, 1)
        gen_at = rows.gen_index
        out = torch.zeros(R * Q, c.patch_latent_dim, device=hidden.device, dtype=torch.float32)
        out[gen_at] = self.llm2vae(self.norm_moe_gen(hidden[gen_at])).float()
        return out.view(R, Q, -1)[:, 1:1 + latents.shape[1]]

    def run_layers(self, hidden: torch.Tensor, rows: "QueryRows", layers: range) -> torch.Tensor:
        """`hidden` [R * Q, D] of `rows` through the decoder layers `layers`, each row against its own cache."""
        c = self.config
        R, Q = rows.valid.shape
        und_at, gen_at = rows.und_index, rows.gen_index
        cos, sin = rope(rows.positions, c.head_dim, c.rope_theta)  # one position per row
        cos, sin = cos[:, None, None].to(hidden.dtype), sin[:, None, None].to(hidden.dtype)
        for i in layers:
            layer = self.layers[i]
            x = _by_expert(hidden, und_at, gen_at, layer.und.input_layernorm, layer.gen.input_layernorm)
            q = hidden.new_zeros(R * Q, c.num_heads, c.head_dim)
            k = hidden.new_zeros(R * Q, c.num_kv_heads, c.head_dim)
            v = torch.zeros_like(k)
            for at, expert in ((und_at, layer.und), (gen_at, layer.gen)):
                q[at], k[at], v[at] = expert.qkv(x[at], c.num_heads, c.num_kv_heads, c.head_dim)
            q = apply_rope(q.view(R, Q, c.num_heads, c.head_dim).transpose(1, 2), cos, sin)
            k = apply_rope(k.view(R, Q, c.num_kv_heads, c.head_dim).transpose(1, 2), cos, sin)
            v = v.view(R, Q, c.num_kv_heads, c.head_dim).transpose(1, 2)
            keys = torch.cat([rows.caches.keys[i], k], dim=2)
            values = torch.cat([rows.caches.values[i], v], dim=2)
            out = attend(q, keys, values, rows.key_mask)
            out = out.transpose(1, 2).reshape(R * Q, -1)
            hidden = hidden + _by_expert(out, und_at, gen_at, layer.und.o_proj, layer.gen.o_proj)
            x = _by_expert(hidden, und_at, gen_at, layer.und.post_attention_layernorm,
                           layer.gen.post_attention_layernorm)
            hidden = hidden + _by_expert(x, und_at, gen_at, layer.und.mlp, layer.gen.mlp)
        return hidden

def _by_expert(x: torch.Tensor, und_at: torch.Tensor, gen_at: torch.Tensor, und, gen) -> torch.Tensor:
    """`und` on the text tokens, `gen` on the latent tokens, zeros on padding."""
    first = und(x[und_at])
    out = x.new_zeros(x.shape[0], first.shape[-1])
    out[und_at] = first
    out[gen_at] = gen(x[gen_at])
    return out


@dataclass
class QueryRows:
    """The query blocks of one forward: row r is `<|vision_start|>`, its N_r latent tokens,
    `<|vision_end|>`, then padding; it attends to its own cache (padded to the longest) and its own block.
    """

    text_ids: torch.Tensor  # [R, 2] long: start and end of image
    positions: torch.Tensor  # [R] long: the RoPE position of every query token of the row
    latent_pos: torch.Tensor  # [R, N_max] long: index into the latent position table (padding: 0)
    valid: torch.Tensor  # [R, Q] bool: real query tokens (Q = N_max + 2)
    end: torch.Tensor  # [R] long: where `<|vision_end|>` sits (N_r + 1)
    und_index: torch.Tensor  # flat indices of text tokens
    gen_index: torch.Tensor  # flat indices of latent tokens
    key_mask: torch.Tensor  # [R, 1, 1, C_max + Q] bool: keys a row may attend to
    caches: PaddedCaches
    counts: tuple = ()  # on the host: each row's latent tokens N_r

    def take(self, taken: list[int]) -> "QueryRows":
        """Rows `taken` (host ints) of these, with their caches: the rows that compute a cached step's later
        layers."""
        index = to_device(taken, self.end.device)
        counts = [self.counts[r] for r in taken]
        Q = self.valid.shape[1]
        pick = lambda x: x.index_select(0, index)  # noqa: E731
        caches = PaddedCaches([pick(k) for k in self.caches.keys], [pick(v) for v in self.caches.values],
                              pick(self.caches.valid))
        return QueryRows(pick(self.text_ids), pick(self.positions), pick(self.latent_pos), pick(self.valid),
                         pick(self.end), to_device(_flat(counts, Q, text=True), index.device),
                         to_device(_flat(counts, Q, text=False), index.device), pick(self.key_mask), caches,
                         tuple(counts))

    @property
    def arange(self) -> torch.Tensor:
        return torch.arange(len(self.end), device=self.end.device)

    @classmethod
    def build(cls, caches: list[KVCache], positions: list[int], grids: list[tuple[int, int]], max_latent_size: int,
              text_ids: tuple[int, int], device: torch.device) -> "QueryRows":
        """Rows for contexts `caches`, RoPE `positions` and latent grids (h, w) of patches."""
        counts = [h * w for h, w in grids]
        n_max = max(counts)
        R, Q = len(caches), n_max + 2
        index = torch.arange(Q, device=device)
        ns = to_device(counts, device)
        valid = index[None] < (ns + 2)[:, None]
        und_index, gen_index = _flat(counts, Q, text=True), _flat(counts, Q, text=False)
        latent_pos = torch.zeros(R, n_max, dtype=torch.long, device=device)
        for r, (h, w) in enumerate(grids):  # patch (i, j) -> i * max_latent_size + j, row-major
            latent_pos[r, :h * w] = (torch.arange(h, device=device)[:, None] * max_latent_size
                                     + torch.arange(w, device=device)).flatten()
        padded = PaddedCaches.of(caches)
        key_mask = torch.cat([padded.valid, valid], dim=1)
        return cls(text_ids=to_device([list(text_ids)] * R, device), positions=to_device(positions, device),
                   latent_pos=latent_pos, valid=valid, end=ns + 1, und_index=to_device(und_index, device),
                   gen_index=to_device(gen_index, device), key_mask=key_mask[:, None, None], caches=padded,
                   counts=tuple(counts))


def _flat(counts: list[int], Q: int, text: bool) -> list[int]:
    """Row r's text tokens sit at 0 and n_r + 1, its latents at 1..n_r: flat indices known on the host, in the
    order `nonzero` of the masks would give them (which would wait for the device on CUDA)."""
    return [r * Q + q for r, n in enumerate(counts) for q in ((0, n + 1) if text else range(1, n + 1))]


def read_llm_config(model_path: Path) -> dict:
    path = Path(model_path) / "llm_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing (a BAGEL checkpoint folder holds llm_config.json, "
                                "ema.safetensors, ae.safetensors and the tokenizer files)")
    return json.loads(path.read_text())


def load_model(model_path: Path, device: torch.device, dtype: torch.dtype) -> BagelModel:
    """`llm_config.json` + `ema.safetensors` from a checkpoint folder, checked key by key."""
    from safetensors.torch import load_file

    state = load_file(str(Path(model_path) / "ema.safetensors"))
    pos = state.get("latent_pos_embed.pos_embed")
    vae2llm = state.get("vae2llm.weight")
    if pos is None or vae2llm is None:
        raise ValueError(f"ema.safetensors: missing key {'latent_pos_embed.pos_embed' if pos is None else 'vae2llm.weight'!r}")
    config = BagelConfig.from_llm_config(read_llm_config(model_path), max_latent_size=math.isqrt(pos.shape[0]),
                                         patch_latent_dim=int(vae2llm.shape[1]))
    model = BagelModel(config)
    model.load_official(state)
    return model.to(device=device, dtype=dtype).eval()
