"""Rows of different image sizes packed into one token sequence, for one denoise forward (beyond diffusers).

The engine's `InputBatch.gather` right-pads rows to the longest image sequence. Running a DiT over that
padding would make a 64x64 row cost what a 128x128 one costs (4x its tokens) in every projection and MLP.
A pipeline's packed forward (qwen_image/, flux/ and sd3/mixed_sizes.py) instead runs every per-token
layer on the real tokens only, one sequence [1, T, D], each token modulated by its own row's timestep
embedding (`per_token`). Only the joint attention sees rows, as variable-length attention through diffusers'
dispatcher, in the form the attention module's backend runs fastest (measured on the CPU: docs/benchmarks.md):

* grouped (every backend but flex): `Packing` groups rows by image token count and each group attends as a
  batch of just those rows would (one call per group, no image padding; diffusers' `flash_varlen` backend
  drops the text padding of each call too);
* segments (the `flex` backend): one call over every row's [text, image] tokens, a block mask keeping each
  token to its own row's segment (and its row's real text), so a batch of eight sizes is one call, not eight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn
from torch.nn.attention.flex_attention import create_block_mask

from engine_lib.host_copy import to_device


@dataclass(frozen=True)
class TokenGroup:
    """Rows of one image token count: packed tokens [start, start + len(rows) * length)."""

    rows: list[int]
    rows_on_device: torch.Tensor
    start: int
    length: int

    def of(self, packed: torch.Tensor) -> torch.Tensor:
        """This group's tokens of a packed [1, T, ...] sequence, as [rows, length, ...]."""
        return packed[0, self.start:self.start + len(self.rows) * self.length].unflatten(0, (len(self.rows), -1))


class Packing:
    """Where each row's image tokens sit in the packed sequence.

    Built once per batch membership (kept with the batch's row inputs) from host ints, so a
    tick reads nothing from the device. Rows are grouped by image token count, groups in order
    of first appearance: the packed sequence holds group after group, each group's rows one
    after another (`order`), so a group is one contiguous slice that views as [rows, n, ...] for
    the joint attention. `token_index` places packed token t in the padded [R * longest] layout
    of the engine's latents, `token_row` names its row. A pipeline's subclass adds its positions.
    """

    def __init__(self, lengths: list[int], device: torch.device) -> None:
        self.device = device
        self._repeats: dict[int, Packing] = {}
        self._kept_for_blocks: dict[str, tuple] = {}  # kind: ((text length, text mask), what `kept` made)
        self.rows, self.longest, self.lengths = len(lengths), max(lengths), list(lengths)  # lengths: per row
        by_length: dict[int, list[int]] = {}
        for row, n in enumerate(lengths):
            by_length.setdefault(n, []).append(row)
        self.order = [row for rows in by_length.values() for row in rows]  # packed order of the rows
        self.groups, start = [], 0
        for n, rows in by_length.items():
            self.groups.append(TokenGroup(rows, to_device(rows, device), start, n))
            start += n * len(rows)
        self.token_rows = [r for r in self.order for _ in range(lengths[r])]  # host: LoRA's token plan
        self.token_index = to_device([r * self.longest + i for r in self.order for i in range(lengths[r])], device)
        self.token_row = to_device(self.token_rows, device)
        # per-row outputs come back group by group; this puts them in row order again (None: already)
        self.row_order = None if self.order == sorted(self.order) else to_device(
            sorted(range(len(self.order)), key=self.order.__getitem__), device)

    def repeated(self, times: int) -> "Packing":
        """The packing of a forward that holds every row `times` over (batched CFG), made once."""
        if times not in self._repeats:
            self._repeats[times] = self._repeat(times)
        return self._repeats[times]

    def _repeat(self, times: int) -> "Packing":
        raise NotImplementedError

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """[R, longest, ...] -> [1, T, ...]: every row's own tokens, padding dropped."""
        return padded.flatten(0, 1).index_select(0, self.token_index).unsqueeze(0)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[1, T, ...] -> [R, longest, ...], the padding zeros."""
        flat = packed.new_zeros(self.rows * self.longest, *packed.shape[2:]).index_copy_(0, self.token_index, packed[0])
        return flat.unflatten(0, (self.rows, self.longest))

    def per_token(self, per_row: torch.Tensor) -> torch.Tensor:
        """[R, D] -> [1, T, D]: each token its own row's value (modulation, gates)."""
        return per_row.index_select(0, self.token_row).unsqueeze(0)

    def in_row_order(self, grouped: torch.Tensor) -> torch.Tensor:
        """[R, ...] in group order (the groups' outputs concatenated) -> [R, ...] in row order."""
        return grouped if self.row_order is None else grouped.index_select(0, self.row_order)

    def norm_out(self, norm_out, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """A DiT's final `AdaLayerNormContinuous` on the packed tokens, each with its own row's scale and shift."""
        scale, shift = norm_out.linear(norm_out.silu(temb).to(x.dtype)).chunk(2, dim=1)
        return norm_out.norm(x) * (1 + self.per_token(scale)) + self.per_token(shift)

    def attend(self, attn, txt_q: torch.Tensor, txt_k: torch.Tensor, txt_v: torch.Tensor, img_q: torch.Tensor,
               img_k: torch.Tensor, img_v: torch.Tensor, txt_mask: Optional[torch.Tensor] = None,
               image_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The joint attention of the module `attn` over each row's [text, image tokens] ([image, text] if
        `image_first`, SD3's order): text [R, L, H, D] (one padded row per request), image packed [1, T, H, D],
        `txt_mask` [R, L] the text's real tokens (None: all). Returns the text part [R, L, H * D] in row order
        and the image part packed [1, T, H * D]."""
        if _backend(attn) == "flex":
            return self._attend_segments(attn, txt_q, txt_k, txt_v, img_q, img_k, img_v, txt_mask)
        masks = self.kept("groups", txt_q.shape[1], txt_mask, lambda: None if txt_mask is None else [
            torch.cat([txt_mask.index_select(0, g.rows_on_device), txt_mask.new_ones(len(g.rows), g.length)],
                      dim=1)[:, None, None, :] for g in self.groups])
        seq_txt = txt_q.shape[1]
        txt_parts, img_parts = [], []
        for index, group in enumerate(self.groups):
            rows = group.rows_on_device
            qkv = [(x.index_select(0, rows), group.of(y)) for x, y in ((txt_q, img_q), (txt_k, img_k), (txt_v, img_v))]
            joint = _attend(attn, *(torch.cat(pair[::-1] if image_first else pair, dim=1) for pair in qkv),
                            mask=None if masks is None else masks[index]).to(txt_q.dtype)
            txt, img = (joint[:, group.length:], joint[:, :group.length]) if image_first else (
                joint[:, :seq_txt], joint[:, seq_txt:])
            txt_parts.append(txt)
            img_parts.append(img.flatten(0, 1))
        return self.in_row_order(torch.cat(txt_parts)), torch.cat(img_parts).unsqueeze(0)

    def _attend_segments(self, attn, txt_q, txt_k, txt_v, img_q, img_k, img_v, txt_mask):
        """`attend` as one call: every row's text (in packed row order) then the packed image tokens, one
        sequence [1, R * L + T, H, D], under a block mask that keeps each query to its own row's tokens."""
        rows, seq_txt = len(self.order), txt_q.shape[1]
        block_mask = self.kept("segments", seq_txt, txt_mask, lambda: self._segment_mask(seq_txt, txt_mask))
        order = to_device(self.order, txt_q.device)
        q, k, v = (torch.cat([t.index_select(0, order).flatten(0, 1), i[0]]).unsqueeze(0)
                   for t, i in ((txt_q, img_q), (txt_k, img_k), (txt_v, img_v)))
        joint = _attend(attn, q, k, v, mask=block_mask).to(txt_q.dtype)[0]
        txt = joint[:rows * seq_txt].unflatten(0, (rows, seq_txt))
        return self.in_row_order(txt), joint[rows * seq_txt:].unsqueeze(0)

    def _segment_mask(self, seq_txt: int, txt_mask: Optional[torch.Tensor]):
        """The block mask of `_attend_segments`' sequence: query q sees key k of its own row, k a real token."""
        text_rows = [r for r in self.order for _ in range(seq_txt)]
        segment = to_device(text_rows + self.token_rows, self.device)
        real = torch.ones(len(segment), dtype=torch.bool, device=self.device)
        if txt_mask is not None:
            real[:len(text_rows)] = txt_mask.index_select(0, to_device(self.order, self.device)).flatten().bool()

        def same_row(batch, head, q, k):
            return (segment[q] == segment[k]) & real[k]

        return create_block_mask(same_row, None, None, len(segment), len(segment), device=self.device)

    def kept(self, kind: str, seq_txt: int, txt_mask: Optional[torch.Tensor], make):
        """`make()` of one kind, made once for all the blocks of a forward: again when the text length or the text
        mask (that very tensor: a forward's blocks share it) changes."""
        key, made = self._kept_for_blocks.get(kind, ((None, None), None))
        if key[0] != seq_txt or key[1] is not txt_mask:
            made = make()
            self._kept_for_blocks[kind] = (seq_txt, txt_mask), made
        return made

    def self_attend(self, attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of packed image tokens [1, T, H, D] each row over its own tokens only -> [1, T, H * D]."""
        parts = [_attend(attn, group.of(q), group.of(k), group.of(v)).to(q.dtype).flatten(0, 1)
                 for group in self.groups]
        return torch.cat(parts).unsqueeze(0)


def condition_rows(states: list) -> dict:
    """Per row of an image-conditioned pipeline's states (Kontext, Qwen-Image-Edit): its condition tokens
    [1, n, C] (`condition`) and its latent token count (`lengths`), for `conditioned_forward`."""
    per_row = [(s, i) for s in states for i in range(s.num_rows)]
    return {"condition": [s.image_latents[i:i + 1] for s, i in per_row],
            "lengths": [s.latents.shape[1] for s, _ in per_row]}


def conditioned_forward(forward, latents: torch.Tensor, rows: dict) -> torch.Tensor:
    """A packed forward whose rows' tokens are their own latent tokens followed by their own condition tokens
    (`condition_rows`): `forward(padded)` over those rows right-padded to the packing's longest ([R, longest, C]
    in, the same out; the caller holds the packing's LoRA plan); each row's prediction cut back to its latent
    tokens, padded to the latents' length."""
    packing, lengths = rows["packing"], rows["lengths"]
    joined = [torch.cat([latents[r:r + 1, :n], condition], dim=1)
              for r, (n, condition) in enumerate(zip(lengths, rows["condition"]))]
    out = forward(torch.cat([F.pad(row, (0, 0, 0, packing.longest - row.shape[1])) for row in joined]))
    return torch.cat([F.pad(out[r:r + 1, :n], (0, 0, 0, latents.shape[1] - n)) for r, n in enumerate(lengths)])


def _backend(attn):
    """The module's processor backend (processors without one, SD3's `JointAttnProcessor2_0`: None, plain SDPA)."""
    return getattr(attn.processor, "_attention_backend", None)


def _attend(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
    """[B, S, H, D] -> [B, S, H * D]: `dispatch_attention_fn` as diffusers' processors call it, with the module's
    processor backend."""
    return dispatch_attention_fn(q, k, v, attn_mask=mask, backend=_backend(attn),
                                 parallel_config=getattr(attn.processor, "_parallel_config", None)).flatten(2, 3)
