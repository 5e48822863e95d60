"""HunyuanImage-3.0's think / recaption: a text written with the language-model head before the image.

The reference (`generate_image(..., bot_task="think" | "recaption")`, its "instruct" template):

* the text phase's context is `<|startoftext|>User: <prompt>\\n\\nAssistant: <think>` (or `<recaption>`),
  each piece tokenized on its own; decoding stops at `</recaption>`, `</answer>` or `<|endoftext|>`
  (kept, as the reference's `generate` keeps it) or at `max_new_tokens`;
* the thought is the whole sequence decoded, after "Assistant: " (a final `<|endoftext|>` dropped):
  `<think>...` with the new text;
* the image's context is `User: <prompt>\\n\\nAssistant: <thought re-encoded><answer><boi>...`; its
  unconditional row has `<cfg>` for every prompt and thought token, but keeps the `<think>`, `</think>`,
  `<recaption>` and `</recaption>` markers when the thought holds a closed pair (`get_cot_sections`).

Decoding is batched: `next_tokens` runs one forward over many requests' last tokens, each against its own
growing cache (`decoder_parts.TextDecode`), through the text head: `TextHead` in one process, the ranks' under
tensor parallelism (tensor_parallel.py's `RankedTextHead`, the same two calls).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from engine_lib.host_copy import to_device
from engine_lib.pipelines.decoder_parts import (KVCache, PaddedCaches, RMSNorm, TextDecode, attend, grow,
                                                 sample_token)
from engine_lib.pipelines.hunyuan_image3.model import read_weights, text_positions
from engine_lib.pipelines.hunyuan_image3.pipeline import Context

TASKS = ("think", "recaption")
STOP_TOKENS = ("</recaption>", "</answer>", "<|endoftext|>")
MARKERS = (("<think>", "</think>"), ("<recaption>", "</recaption>"))
HEAD_KEYS = ("lm_head.weight", "model.ln_f.weight")  # the text head's tensors in the checkpoint


class TextHead(nn.Module):
    """The checkpoint's `model.ln_f` and `lm_head`: hidden states to logits."""

    def __init__(self, hidden: int, vocab: int, eps: float):
        super().__init__()
        self.ln_f = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden)).float()

    def logits(self, model, caches: list[KVCache], token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`token_ids` [R, 1] after their caches through `model` and this head: the logits [R, vocab] on the host,
        and the keys and values of the ids fed (`grown` appends them); changes no cache."""
        new, hidden = extend(model, caches, token_ids)
        return self(hidden).cpu(), new

    @staticmethod
    def grown(cache: KVCache, new: torch.Tensor) -> KVCache:
        return grow(cache, new)

    @classmethod
    def load(cls, folder: str, config, device, dtype) -> Optional["TextHead"]:
        """The head from the folder's shards (no other tensor read), None when they lack it."""
        state = {**read_weights(Path(folder), prefix="lm_head."),
                 **{f"ln_f.{k}": v for k, v in read_weights(Path(folder), prefix="model.ln_f.").items()}}
        if set(state) != {"weight", "ln_f.weight"}:
            return None
        head = cls(config.hidden_size, config.vocab_size, config.rms_norm_eps)
        head.load_state_dict({"lm_head.weight": state["weight"], "ln_f.weight": state["ln_f.weight"]})
        return head.to(device=device, dtype=dtype).eval()


@torch.no_grad()
def extend(model, caches: list[KVCache], token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_ids` [R, L] after row r's context `caches[r]`, causally, at text positions continuing it (caches
    padded and masked); changes no cache. Returns their keys and values [R, layers, 2, kv_heads, L, d] (`grow`
    appends them) and each row's last hidden state [R, D]."""
    R, L = token_ids.shape
    hidden = model.model.wte(token_ids)
    padded = PaddedCaches.of(caches)
    positions = torch.stack([text_positions(c.length, c.length + L) for c in caches])  # on the host
    cos, sin = model.rope(to_device(positions, hidden.device))
    causal = torch.ones(L, L, dtype=torch.bool, device=hidden.device).tril()
    mask = torch.cat([padded.valid[:, None].expand(R, L, -1), causal.expand(R, L, L)], dim=2)[:, None]
    keys, values = [], []
    for i, layer in enumerate(model.model.layers):
        q, k, v = layer.self_attn.qkv(layer.input_layernorm(hidden), cos, sin)
        keys.append(k)
        values.append(v)
        out = attend(q, torch.cat([padded.keys[i], k], dim=2), torch.cat([padded.values[i], v], dim=2), mask)
        hidden = hidden + layer.self_attn.o_proj(out.transpose(1, 2).reshape(R, L, -1))
        hidden = layer.feed_forward(hidden)
    return torch.stack([torch.stack(keys, 1), torch.stack(values, 1)], 2), hidden[:, -1]


class Thinker:
    """The text phase and the image context after it, for a `HunyuanImage3Pipeline` and its text head."""

    def __init__(self, pipe, head: TextHead):
        self.pipe, self.head, tok = pipe, head, pipe.tokenizer
        self.stops = {tok.convert_tokens_to_ids(t) for t in STOP_TOKENS}
        self.eos = tok.convert_tokens_to_ids("<|endoftext|>")
        self.answer = tok.convert_tokens_to_ids("<answer>")

    def encode(self, text: str) -> list[int]:
        return self.pipe.tokenizer.encode(text, add_special_tokens=False)

    def text_ids(self, prompt: str, task: str) -> list[int]:
        """The text phase's context (the reference's gen_text template with the assistant prefix)."""
        return [self.pipe.bos, *self.encode("User: "), *self.encode(prompt), *self.encode("\n\n"),
                *self.encode(f"Assistant: <{task}>")]

    def start(self, context: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0) -> TextDecode:
        """All but the context's last token prefilled; that one is fed first."""
        cache = self.pipe.model.prefill(torch.tensor(context[:-1], device=self.pipe.device))
        return TextDecode(cache, int(max_new_tokens), float(temperature), int(seed), [context[-1]])

    @torch.no_grad()
    def next_tokens(self, decodes: Sequence[TextDecode]) -> tuple[list[int], torch.Tensor]:
        """One forward for many decodes, each its last id against its own cache; changes nothing. Each one's next
        token and the keys and values of the id fed (`advance` takes both)."""
        last = torch.tensor([[d.ids[-1]] for d in decodes], device=self.pipe.device)
        logits, new = self.head.logits(self.pipe.model, [d.cache for d in decodes], last)
        return [sample_token(row, d) for d, row in zip(decodes, logits)], new

    def advance(self, decode: TextDecode, token: int, new: Optional[torch.Tensor]) -> None:
        """The token kept; it ends on an end token or at `max_new_tokens`."""
        decode.cache = self.head.grown(decode.cache, new)
        decode.ids.append(token)
        decode.done = token in self.stops or decode.new_tokens >= decode.max_new_tokens

    def generate(self, context: list[int], max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0) -> TextDecode:
        """One request's whole decode, token by token."""
        decode = self.start(context, max_new_tokens, temperature, seed)
        while not decode.done:
            [token], new = self.next_tokens([decode])
            self.advance(decode, token, None if new is None else new[0])
        return decode

    def thought(self, context: list[int], decode: TextDecode) -> str:
        """The reference's `get_cot_text`: the whole sequence decoded, after "Assistant: "."""
        ids = context + decode.ids[1:]
        if ids[-1] == self.eos:
            ids = ids[:-1]
        return self.pipe.tokenizer.decode(ids).split("Assistant: ")[1]

    def sections(self, thought: str) -> list[tuple[str, bool]]:
        """The reference's `get_cot_sections`: (text, replaced by `<cfg>` in the unconditional row)."""
        if not thought:
            return []
        for start, end in MARKERS:
            if start in thought and end in thought:
                before, inner = thought.split(start)[0], thought.split(start)[1].split(end)[0]
                return (self.sections(before) + [(start, False), (inner, True), (end, False)] +
                        self.sections(thought.split(end)[1]))
        return [(thought, True)]

    def image_ids(self, prompt: str, thought: str, height: int, width: int, uncond: bool = False) -> list[int]:
        """The image's context up to its ratio token, with the thought (`<cfg>` where the reference drops)."""
        def part(text: str, droppable: bool) -> list[int]:
            ids = self.encode(text)
            return [self.pipe.cfg] * len(ids) if uncond and droppable else ids

        ids = [self.pipe.bos, *self.encode("User: "), *part(prompt, True), *self.encode("\n\n"),
               *self.encode("Assistant: ")]
        for text, droppable in self.sections(thought):
            ids += part(text, droppable)
        p = self.pipe
        return ids + [self.answer, p.boi, p.img_size, p.ratio_tokens[p.bucket(height, width)]]

    @torch.no_grad()
    def context(self, prompt: str, thought: str, height: int, width: int, cfg: bool) -> Context:
        """The image's contexts after the thought, prefilled."""
        def prefill(uncond: bool) -> KVCache:
            ids = self.image_ids(prompt, thought, height, width, uncond)
            return self.pipe.model.prefill(torch.tensor(ids, device=self.pipe.device))

        size = self.pipe.token_size
        return Context(prefill(False), prefill(True) if cfg else None, (height // size, width // size))
