"""Prompt embeddings kept between requests: repeated prompts are common, and encoding is a fixed cost.

Keyed by everything the embeddings depend on (the adapter builds the key: pipeline,
prompt, negative prompt when CFG runs, text length, images per prompt, LoRA, and for
the edit models, which encode the prompt with the input images, those images' digests), bounded
in bytes, least recently used evicted. A hit hands out the very tensors a fresh
encode of the same request made (each request encodes alone), so images do not
change (solo bitwise parity holds); the dicts are copied, so a state that moves its
tensors (pause to host memory) never touches the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable

import torch


def _nbytes(text: dict) -> int:
    return sum(t.numel() * t.element_size() for parts in text.values() for t in parts.values()
               if isinstance(t, torch.Tensor))


def _copy(text: dict) -> dict:
    return {side: dict(parts) for side, parts in text.items()}


class TextEmbeddingCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max(0, int(max_bytes))
        self._entries: "OrderedDict[Hashable, tuple[dict, int]]" = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def get_or_encode(self, key: Hashable, encode: Callable[[], dict]) -> dict:
        """The cached embeddings of `key` (side -> TextParts), else `encode()`, kept if they fit."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return _copy(entry[0])
        self.misses += 1
        text = encode()
        size = _nbytes(text)
        if 0 < size <= self.max_bytes:
            self._entries[key] = (_copy(text), size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted
        return text

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
