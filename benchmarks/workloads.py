"""What the load generator sends: request specs and the three workloads of the issue.

A workload is a deterministic list of `RequestSpec`s (seeded), so every system in
one run sees exactly the same requests in the same order.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, replace
from typing import Sequence

PROMPTS = (
    "a photo of a cat sitting on a red chair in the sun",
    "an astronaut riding a horse on the moon, high quality, detailed",
    "a bowl of fruit on a wooden table, soft light, blue background",
    "a small dog running in the green grass next to a river",
    "portrait of a woman with long hair, studio lighting, 4k",
    "a red car parked in front of a white house under a cloudy sky",
)


@dataclass(frozen=True)
class RequestSpec:
    """One generation request, as the Triton inputs of DESIGN.md "Triton interface" carry it."""

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

    @property
    def shape_key(self) -> str:
        """Requests with the same key have the same solo latency (the SLO is per key)."""
        return f"{self.height}x{self.width}/{self.steps}" + (f"/{self.num_frames}f" if self.num_frames else "")

    def to_dict(self) -> dict:
        return asdict(self)


def uniform(n: int, size: int, steps: int, preview_interval: int = 0, seed: int = 0) -> list[RequestSpec]:
    """n requests of one size and one step count (prompts and seeds vary)."""
    return [_spec(i, size, size, steps, preview_interval, seed) for i in range(n)]


def mixed_loras(n: int, size: int, steps: int, names: Sequence[str], seed: int = 0) -> list[RequestSpec]:
    """n requests of one shape cycling through LoRA names ("" = none)."""
    return [replace(spec, lora_name=names[i % len(names)]) for i, spec in enumerate(uniform(n, size, steps, 0, seed))]


def mixed_steps(n: int, size: int, step_choices: Sequence[int], preview_interval: int = 0,
                seed: int = 0) -> list[RequestSpec]:
    """n requests of one size whose step counts are drawn uniformly from step_choices."""
    rng = random.Random(seed)
    return [_spec(i, size, size, rng.choice(list(step_choices)), preview_interval, seed) for i in range(n)]


def mixed_sizes(n: int, sizes: Sequence[int], steps: int, preview_interval: int = 0,
                seed: int = 0) -> list[RequestSpec]:
    """n requests of one step count whose (square) sizes are drawn uniformly from sizes."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        size = rng.choice(list(sizes))
        out.append(_spec(i, size, size, steps, preview_interval, seed))
    return out


def distinct_shapes(specs: Sequence[RequestSpec]) -> list[RequestSpec]:
    """One representative spec per shape key, in first-seen order (for solo-latency calibration)."""
    seen: dict[str, RequestSpec] = {}
    for spec in specs:
        seen.setdefault(spec.shape_key, spec)
    return list(seen.values())


def _spec(i: int, height: int, width: int, steps: int, preview_interval: int, seed: int) -> RequestSpec:
    return RequestSpec(prompt=PROMPTS[i % len(PROMPTS)], height=height, width=width, steps=steps,
                       seed=seed * 100_003 + i, preview_interval=preview_interval)
