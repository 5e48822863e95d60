"""The `packing` scenario: one denoise forward over rows of several sizes, packed vs per size vs padded (in-process).

For Qwen-Image, Flux and SD3, a random-weight transformer of the tiny preset's config widened to 4 heads of 64 runs
8 rows (WORKLOADS) three ways: packed (the pipeline's `packed_forward`, `mixed_size_batching`: joint attention one
call per group of rows of one token count; for Qwen-Image and Flux also `packed flex`, one call a block under a block
mask on the flex backend), per size (diffusers' forward once per size, what size-keyed step batching runs) and padded
(every row at the largest size, what right-padding would compute). Timings interleaved over `repeats` rounds,
medians; docs/benchmarks.md (`packing`)."""

from __future__ import annotations

import json
import statistics
from typing import Callable

import torch

from benchmarks.offline import timed

# Patch tokens per side (x --scale) of each workload's rows, equal sizes next to each other.
WORKLOADS = {"two sizes": [(8, 8)] * 4 + [(16, 16)] * 4,
             "eight sizes": [(8, 8), (8, 10), (10, 10), (10, 12), (12, 12), (12, 14), (14, 14), (16, 16)]}
TEXT_TOKENS = 32
WIDE = dict(attention_head_dim=64, num_attention_heads=4)


class Setup:
    """Where, at what scale and for which row sizes one measurement builds its inputs."""

    def __init__(self, device: str, dtype: str, scale: int, sizes: list[tuple[int, int]]) -> None:
        self.device, self.dtype = torch.device(device), getattr(torch, dtype)
        self.sizes = [(scale * h, scale * w) for h, w in sizes]
        self.largest = max(self.sizes, key=lambda size: size[0] * size[1])
        self.by_size: list[tuple[tuple[int, int], slice]] = []  # each size and its rows (adjacent)
        for row, size in enumerate(self.sizes):
            if self.by_size and self.by_size[-1][0] == size:
                self.by_size[-1] = (size, slice(self.by_size[-1][1].start, row + 1))
            else:
                self.by_size.append((size, slice(row, row + 1)))
        self.gen = torch.Generator().manual_seed(0)

    def randn(self, *shape: int, dtype=None) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.device, dtype or self.dtype)


def _transformer(name: str, setup: Setup, **overrides):
    """The tiny preset's transformer config with `overrides`, random weights, in eval mode, on the setup's device.
    Only the config is read (the class diffusers saved with it): no pipeline, weights or text encoder load."""
    import diffusers

    from engine_lib.pipelines.tiny_models import ensure_model

    config = json.loads((ensure_model(name, "tiny") / "transformer" / "config.json").read_text())
    torch.manual_seed(0)
    transformer = getattr(diffusers, config["_class_name"]).from_config({**config, **overrides})
    return transformer.to(setup.device, setup.dtype).eval()


def qwen_image_forwards(setup: Setup) -> dict[str, Callable[[], object]]:
    from engine_lib.pipelines.qwen_image.mixed_sizes import QwenPacking, packed_forward

    t = _transformer("qwen_image", setup, num_layers=6, axes_dims_rope=[16, 24, 24], **WIDE)
    rows, shapes = len(setup.sizes), [(1, h, w) for h, w in setup.sizes]
    latents = setup.randn(rows, max(h * w for h, w in setup.sizes), t.config.in_channels)
    timestep, text = setup.randn(rows).abs(), setup.randn(rows, TEXT_TOKENS, t.config.joint_attention_dim)
    mask = torch.ones(rows, TEXT_TOKENS, dtype=torch.long, device=setup.device)
    packing = QwenPacking(t.pos_embed, shapes, setup.device)

    def diffusers(rows: slice, size: tuple) -> None:
        t(hidden_states=latents[rows, :size[0] * size[1]], timestep=timestep[rows], encoder_hidden_states=text[rows],
          encoder_hidden_states_mask=mask[rows], img_shapes=[[(1, *size)]] * (rows.stop - rows.start),
          return_dict=False)

    return _three(setup, lambda: packed_forward(t, latents, timestep, None, text, mask, packing), diffusers, t)


def flux_forwards(setup: Setup) -> dict[str, Callable[[], object]]:
    from diffusers import FluxPipeline

    from engine_lib.pipelines.flux.mixed_sizes import FluxPacking, packed_forward

    t = _transformer("flux", setup, num_layers=2, num_single_layers=4, axes_dims_rope=[16, 24, 24], **WIDE)

    def ids(size: tuple) -> torch.Tensor:
        return FluxPipeline._prepare_latent_image_ids(1, *size, setup.device, setup.dtype)

    rows = len(setup.sizes)
    latents = setup.randn(rows, max(h * w for h, w in setup.sizes), t.config.in_channels)
    timestep, text = setup.randn(rows).abs(), setup.randn(rows, TEXT_TOKENS, t.config.joint_attention_dim)
    pooled = setup.randn(rows, t.config.pooled_projection_dim)
    guidance = torch.full((rows,), 3.5, device=setup.device) if t.config.guidance_embeds else None
    txt_ids = torch.zeros(TEXT_TOKENS, 3, device=setup.device, dtype=setup.dtype)
    packing = FluxPacking(t.pos_embed, txt_ids, [ids(size) for size in setup.sizes], setup.device)

    def diffusers(rows: slice, size: tuple) -> None:
        t(hidden_states=latents[rows, :size[0] * size[1]], timestep=timestep[rows],
          guidance=None if guidance is None else guidance[rows], pooled_projections=pooled[rows],
          encoder_hidden_states=text[rows], txt_ids=txt_ids, img_ids=ids(size), return_dict=False)

    return _three(setup, lambda: packed_forward(t, latents, timestep, guidance, pooled, text, packing), diffusers, t)


def sd3_forwards(setup: Setup) -> dict[str, Callable[[], object]]:
    from engine_lib.pipelines.sd3.mixed_sizes import SD3Packing, from_tokens, packed_forward

    t = _transformer("sd3", setup, num_layers=6, caption_projection_dim=256, **WIDE)
    patch, rows = t.config.patch_size, len(setup.sizes)
    pixels = [(h * patch, w * patch) for h, w in setup.sizes]  # latent pixels
    latents = setup.randn(rows, max(h * w for h, w in pixels), t.config.in_channels)
    timestep, text = 1000 * setup.randn(rows).abs(), setup.randn(rows, TEXT_TOKENS, t.config.joint_attention_dim)
    pooled = setup.randn(rows, t.config.pooled_projection_dim)
    packing = SD3Packing(pixels, patch, setup.device)

    def diffusers(rows: slice, size: tuple) -> None:
        h, w = size[0] * patch, size[1] * patch
        t(hidden_states=from_tokens(latents[rows, :h * w], h, w), timestep=timestep[rows],
          pooled_projections=pooled[rows], encoder_hidden_states=text[rows], return_dict=False)

    return _three(setup, lambda: packed_forward(t, latents, timestep, pooled, text, packing), diffusers)


def _three(setup: Setup, packed: Callable[[], object], diffusers: Callable[[slice, tuple], None],
           flex_on=None) -> dict[str, Callable[[], object]]:
    """The ways to run one workload; with `flex_on` (a transformer whose processors take a backend) also the
    packed forward on diffusers' flex backend (its joint attention one call a block under a block mask)."""
    ways = {"packed": packed, "per_size": lambda: [diffusers(rows, size) for size, rows in setup.by_size],
            "padded": lambda: diffusers(slice(0, len(setup.sizes)), setup.largest)}
    if flex_on is not None:
        ways["packed_flex"] = lambda: _on_flex(flex_on, packed)
    return ways


def _on_flex(transformer, call: Callable[[], object]) -> object:
    processors = [m.processor for m in transformer.modules() if hasattr(m, "processor")]
    for backend in ("flex", None):  # None: the processors' default again
        for processor in processors:
            processor._attention_backend = backend
        if backend:
            out = call()
    return out


PIPELINES = {"qwen_image": qwen_image_forwards, "flux": flux_forwards, "sd3": sd3_forwards}


def run(repeats: int = 15, device: str = "cpu", dtype: str = "float32", scale: int = 1) -> dict:
    threads = torch.get_num_threads()
    if torch.device(device).type == "cpu":
        torch.set_num_threads(1)
    results = {"workload": {"sizes": {name: [[scale * n for n in size] for size in sizes]
                                      for name, sizes in WORKLOADS.items()},
                            "text_tokens": TEXT_TOKENS, "heads": WIDE, "repeats": repeats, "device": device,
                            "dtype": dtype, "threads": torch.get_num_threads() if device == "cpu" else None},
               "points": []}
    try:
        with torch.inference_mode():
            for pipeline, build in PIPELINES.items():
                for workload, sizes in WORKLOADS.items():
                    setup = Setup(device, dtype, scale, sizes)
                    forwards = build(setup)
                    times: dict[str, list[float]] = {kind: [] for kind in forwards}
                    for call in forwards.values():
                        call()  # warm-up
                    for _ in range(repeats):
                        for kind, call in forwards.items():
                            times[kind] += timed(call, 1)
                    ms = {kind: 1000 * statistics.median(values) for kind, values in times.items()}
                    results["points"].append({"pipeline": pipeline, "workload": workload, "median_ms": ms,
                                              "per_size_over_packed": ms["per_size"] / ms["packed"],
                                              "padded_over_packed": ms["padded"] / ms["packed"]})
    finally:
        torch.set_num_threads(threads)
    return results
