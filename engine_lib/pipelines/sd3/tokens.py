"""The layout the engine keeps SD3 latents in: tokens [N, h * w, C], not diffusers' [N, C, h, w].

Every path that turns one into the other goes through these two (the adapter's first latents and forwards,
the packed and cached forwards, the VAE decode).
"""

from __future__ import annotations

import torch


def to_tokens(latents: torch.Tensor) -> torch.Tensor:
    """[N, C, h, w] -> [N, h * w, C]: the layout the engine keeps SD3 latents in, so rows of different sizes
    pad and pack along one token axis as the other pipelines' latents do (a permutation: values exact)."""
    return latents.flatten(2).transpose(1, 2)


def from_tokens(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[N, h * w, C] -> [N, C, h, w], contiguous (a conv on channels-last strides may round differently)."""
    return tokens.transpose(1, 2).unflatten(2, (height, width)).contiguous()
