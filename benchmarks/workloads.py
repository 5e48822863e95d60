"""What the load generator sends: request specs, and deterministic (seeded) workloads of them, so that every
system of a run sees exactly the same requests in the same order."""

from __future__ import annotations

import functools
import io
import random
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

PROMPTS = ("a photo of a cat sitting on a red chair in the sun",
           "an astronaut riding a horse on the moon, high quality, detailed",
           "a bowl of fruit on a wooden table, soft light, blue background",
           "a small dog running in the green grass next to a river",
           "portrait of a woman with long hair, studio lighting, 4k",
           "a red car parked in front of a white house under a cloudy sky")
# Edits (image-to-image): eight, so that no two of eight consecutive requests share one.
EDIT_PROMPTS = ("make it winter, snow on every surface", "turn it into a watercolor painting",
                "at night under a full moon", "make the sky orange at sunset", "as a pencil sketch on white paper",
                "add heavy rain and puddles", "in the style of a mosaic of small tiles", "make everything blue and gold")


@dataclass(frozen=True)
class RequestSpec:
    """One generation request, as the model's Triton inputs carry it (docs/serving.md)."""

    prompt: str
    height: int
    width: int
    steps: int
    seed: int
    num_images: int = 1
    preview_interval: int = 0
    lora_name: str = ""  # "": no LoRA (the input is not sent)
    priority: int = 0  # 0: not sent (the model's default level)
    num_frames: int = 0  # video models: frames asked for (0: not sent, an image model)
    cache: str = ""  # the step cache (e.g. first_block; "": not sent, the model's default)
    cache_threshold: float = 0.0  # sent with `cache`
    image_seed: int = 0  # image-to-image: an input image of the request's size drawn from this seed (0: none)
    strength: float = 1.0  # sent with an input image

    @property
    def shape_key(self) -> str:
        """Requests with the same key have the same solo latency (the SLO is per key)."""
        return f"{self.height}x{self.width}/{self.steps}" + (f"/{self.num_frames}f" if self.num_frames else "")


def generate(n: int, sizes: Sequence[int], steps: Sequence[int], seed: int = 0, preview_interval: int = 0,
             loras: Sequence[str] = ("",), num_frames: int = 0, priority: int = 0) -> list[RequestSpec]:
    """n requests whose (square) size and step count are drawn uniformly from `sizes` and `steps` (seeded;
    a single choice is not drawn), cycling through `loras` ("" = none); prompts cycle, seeds differ."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        size = sizes[0] if len(sizes) == 1 else rng.choice(list(sizes))
        count = steps[0] if len(steps) == 1 else rng.choice(list(steps))
        out.append(RequestSpec(prompt=PROMPTS[i % len(PROMPTS)], height=size, width=size, steps=count,
                               seed=seed * 100_003 + i, preview_interval=preview_interval,
                               lora_name=loras[i % len(loras)], priority=priority, num_frames=num_frames))
    return out


def edits(specs: Sequence[RequestSpec], strength: float) -> list[RequestSpec]:
    """The same requests as image-to-image edits: each its own input image (drawn from its seed) and edit prompt."""
    return [replace(spec, prompt=EDIT_PROMPTS[i % len(EDIT_PROMPTS)], image_seed=spec.seed + 1, strength=strength)
            for i, spec in enumerate(specs)]


@functools.lru_cache(maxsize=256)
def input_image(seed: int, height: int, width: int) -> bytes:
    """A PNG of random colour blocks (8x8 pixels each, so the VAE sees shapes, not only noise), drawn from `seed`."""
    from PIL import Image

    blocks = np.random.default_rng(seed).integers(0, 256, ((height + 7) // 8, (width + 7) // 8, 3), dtype=np.uint8)
    pixels = blocks.repeat(8, axis=0).repeat(8, axis=1)[:height, :width]
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def distinct_shapes(specs: Sequence[RequestSpec]) -> list[RequestSpec]:
    """One representative spec per shape key, in first-seen order (for solo-latency calibration)."""
    seen: dict[str, RequestSpec] = {}
    for spec in specs:
        seen.setdefault(spec.shape_key, spec)
    return list(seen.values())
