"""What our own LLM-style image models (BAGEL, HunyuanImage-3.0) really share, and nothing more.

Both are decoder-only transformers that denoise image tokens against a prompt
prefilled once per request. So both need: a request's own KV cache of its prompt,
many such caches of different lengths padded into one forward (with the mask
that hides the padding), the small pieces of math their reference code shares
(Qwen/Hunyuan RMSNorm, rotate-half RoPE, DiT's sinusoidal timestep embedding),
the shifted flow-matching schedule both step with Euler, the first-block cache around their
layer stacks (`first_layer_cache`), and a text phase's growing context, token choice and
streamed chunks (`TextDecode`, `grow`, `sample_token`, `text_chunk`: BAGEL's think and answers, Hunyuan's
think and recaption).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine_lib.host_copy import to_device
from engine_lib.pipelines.checkpoint import group_indices
from engine_lib.pipelines.step_cache import should_compute


@dataclass
class KVCache:
    """One context's keys and values per layer, [kv_heads, length, head_dim] each (positions applied)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[1]) if self.keys else 0

    def empty(self) -> "KVCache":
        """A zero-length cache of the same layers (a context with no prompt)."""
        return KVCache([k[:, :0] for k in self.keys], [v[:, :0] for v in self.values])


def grow(cache: KVCache, new: torch.Tensor) -> KVCache:
    """`cache` with one row's keys and values of a model's `extend` ([layers, 2, kv_heads, L, d]) appended: a new
    cache (the one it grew from stays as it was)."""
    return KVCache([torch.cat([k, n[0]], dim=1) for k, n in zip(cache.keys, new)],
                   [torch.cat([v, n[1]], dim=1) for v, n in zip(cache.values, new)])


@dataclass
class TextDecode:
    """One request's text being decoded. Its context grows by each token fed back, as a new cache: the context it
    started from stays as it was (the references decode on a copy)."""

    cache: KVCache
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    seed: int = 0  # sampling's: token k is drawn with a generator seeded by (seed, k)
    ids: list[int] = field(default_factory=list)  # the token fed first, then the new ones
    done: bool = False

    @property
    def new_tokens(self) -> int:
        return len(self.ids) - 1


def text_chunk(state, text: str) -> Optional[dict]:
    """A text phase's intermediate output: the characters of `text` (the whole text so far) after `state.streamed`
    (those sent), as `text`; None when there are none. While `state.text` decodes, a partial UTF-8 character at
    the end (decoded as U+FFFD) waits for its bytes."""
    if not state.text.done:
        text = text.rstrip("\ufffd")
    if len(text) <= len(state.streamed) or not text.startswith(state.streamed):
        return None
    new, state.streamed = text[len(state.streamed):], text
    return {"text": np.array([new], dtype=object)}


class TextPhase:
    """A request state that may write text before its image: its dataclass has `text` (a TextDecode once the
    text phase starts) and `first_denoise_step` (the step index after the text's steps)."""

    @property
    def decoding(self) -> bool:
        """In its text phase: the next step decodes a token (one zero latent token stands in)."""
        return self.text is not None and not self.text.done

    @property
    def denoise_index(self) -> int:
        return self.step_index - self.first_denoise_step


def decode_text_rows(model, states: Sequence, rows: list[int]) -> dict:
    """One text forward of `model.next_tokens` for `rows`, the requests in their text phase (none: no forward, and
    `model` may be None): `token` [B], each one's next token (-1 for the others), and `kv` [B, 1, ...], the keys
    and values of the token it fed (zeros for the others; absent when the model grew its caches itself)."""
    out = {"token": torch.full((len(states),), -1, dtype=torch.long)}
    if rows:
        tokens, new = model.next_tokens([states[i].text for i in rows])
        if new is not None:  # None: the caches grew where they live (tensor-parallel ranks)
            out["kv"] = new.new_zeros(len(states), 1, *new.shape[1:])
            out["kv"][rows, 0] = new
        out["token"][rows] = torch.tensor(tokens)
    return out


def held_bytes(*held) -> int:
    """The bytes of the tensor storages reachable from `held` (through dataclasses, dicts, lists and tuples), each
    storage counted once: what a state or a rank's caches keep alive, views included."""
    storages, seen, todo = {}, set(), list(held)
    while todo:
        value = todo.pop()
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif id(value) in seen or value is None or isinstance(value, (str, bytes, int, float, bool)):
            continue
        elif isinstance(value, dict):
            seen.add(id(value))
            todo += value.values()
        elif isinstance(value, (list, tuple, set)):
            seen.add(id(value))
            todo += value
        elif dataclasses.is_dataclass(value):
            seen.add(id(value))
            todo += [getattr(value, f.name) for f in dataclasses.fields(value)]
    return sum(storages.values())


def sample_token(logits: torch.Tensor, d: TextDecode) -> int:
    """The next token from one row's logits: the argmax at temperature 0, else a draw seeded per token, so a
    forward run again (a batch retried row by row) draws the same token."""
    if d.temperature <= 0:
        return int(torch.argmax(logits))
    seed = int(np.random.SeedSequence((d.seed, d.new_tokens)).generate_state(1)[0])
    probs = torch.softmax(logits / d.temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed)))


@dataclass
class PaddedCaches:
    """Caches of one forward right-padded to the longest: per layer [R, kv_heads, C_max, d], and which keys are real."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor  # [R, C_max] bool

    @classmethod
    def of(cls, caches: list[KVCache]) -> "PaddedCaches":
        longest = max(cache.length for cache in caches)
        device = caches[0].keys[0].device
        lengths = to_device([cache.length for cache in caches], device)
        valid = torch.arange(longest, device=device)[None] < lengths[:, None]
        layers = range(len(caches[0].keys))
        return cls([_pad_stack([c.keys[i] for c in caches], longest) for i in layers],
                   [_pad_stack([c.values[i] for c in caches], longest) for i in layers], valid)


def _pad_stack(tensors: list[torch.Tensor], length: int) -> torch.Tensor:
    return torch.stack([F.pad(t, (0, 0, 0, length - t.shape[1])) for t in tensors])


def first_layer_cache(run: Callable, hidden: torch.Tensor, rows, groups: list, num_layers: int) -> torch.Tensor:
    """diffusers' FirstBlockCache per row group (engine_lib/pipelines/step_cache.py) around a layer stack whose rows
    hold one token, then their image tokens at 1..n (`group.tokens`), then padding. `run(hidden [R, Q, D], rows,
    layers)` runs `layers` over the rows `rows` describe; `rows.take(taken)` describes the rows `taken` alone
    (their caches, masks and positions).

    The first layer runs over every row; each group decides from its own image tokens' residual
    (`should_compute`); the rows that compute run the other layers on their own, and a row that reuses
    leaves with its last tail residual added to its image tokens (the only ones the way out reads)."""
    R = hidden.shape[0]
    head = run(hidden, rows, range(1))
    head_residual = (head - hidden)[:, 1:]
    compute = should_compute(groups, head_residual)
    for group, computes in zip(groups, compute):
        if group.tally is not None:
            group.tally["computed" if computes else "reused"] += 1
    taken = [r for g, c in zip(groups, compute) if c for r in range(g.rows.start, g.rows.stop)]
    if len(taken) == R:
        out = run(head, rows, range(1, num_layers))
    else:
        out = head.clone()
        if taken:
            index = to_device(taken, head.device)
            out.index_copy_(0, index, run(head.index_select(0, index), rows.take(taken), range(1, num_layers)))
    for group, computes in zip(groups, compute):
        n = group.tokens
        if computes and group.cache is not None:
            group.cache.head_residual = group.own(head_residual).clone()
            group.cache.tail_residual = (out[group.rows] - head[group.rows])[:, 1:1 + n]
        elif not computes:
            out[group.rows, 1:1 + n] = group.cache.tail_residual + head[group.rows, 1:1 + n]
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA with grouped KV heads repeated to the query heads (as both references do), boolean mask."""
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                          attn_mask=mask)


class RMSNorm(nn.Module):
    """Qwen2's and Hunyuan's RMSNorm: normalised in float32, scaled in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000) -> torch.Tensor:
    """DiT's sinusoidal embedding [cos, sin] of (fractional) timesteps t [N]."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half).to(t.device)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def shifted_schedule(num_steps: int, shift: float) -> torch.Tensor:
    """The num_steps + 1 noise levels of a shifted flow-matching schedule, from 1 down to 0 (float32):
    `linspace(1, 0, n + 1)` through `s t / (1 + (s - 1) t)` (BAGEL's and HunyuanImage-3's, SD3's shift)."""
    t = torch.linspace(1, 0, num_steps + 1)
    return shift * t / (1 + (shift - 1) * t)


def decode_by_grid(states: Sequence, decode: Callable[[list[torch.Tensor], tuple[int, int]], torch.Tensor]) -> list[dict]:
    """`post_decode` for states holding `context.grid` and `latents`: one `decode(latents, grid)` call per image
    size (float images [B, H, W, 3] on the device; the runner brings them to the host once per tick),
    `{"image": [1, H, W, 3]}` per state."""
    out: list[dict] = [{} for _ in states]
    for grid, indices in group_indices([state.context.grid for state in states]).items():
        images = decode([states[i].latents for i in indices], grid)
        for k, i in enumerate(indices):
            out[i] = {"image": images[k:k + 1]}
    return out
