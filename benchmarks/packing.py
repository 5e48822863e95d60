"""`make bench-packing`: one denoise forward over rows of two sizes, packed vs per size vs padded, per pipeline.

For Qwen-Image, Flux and SD3, in one process on one thread, a random-weight transformer of
the tiny preset's config widened to 4 heads of 64 (Qwen-Image's bench preset width; speed
does not depend on weight values) runs 4 rows of 8x8 patch tokens and 4 of 16x16 (64x64 and
128x128 images at VAE factor 8, patch 2), 32 text tokens, each row its own timestep:

* packed: the pipeline's `packed_forward` (`mixed_size_batching`), every row in one forward;
* per size: diffusers' forward once per size, what size-keyed step batching runs;
* padded: diffusers' forward of all 8 rows at the larger size, what right-padding the small
  rows would compute (without the masks that would make it correct).

Timings interleaved, `repeats` rounds, medians. Results: benchmarks/results/packing.json;
docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from benchmarks.run import machine_info, side_main

SMALL, LARGE, ROWS_PER_SIZE, TEXT_TOKENS = (8, 8), (16, 16), 4, 32  # patch tokens per side; rows; text
WIDE = dict(attention_head_dim=64, num_attention_heads=4)


def _transformer(name: str, **overrides):
    """The tiny preset's transformer config with `overrides`, random weights, in eval mode."""
    from engine_lib.pipelines.registry import load_adapter
    from engine_lib.config import EngineConfig
    from engine_lib.tiny_models import ensure_model

    pipe = load_adapter(EngineConfig(pipeline=name, model_path=str(ensure_model(name, "tiny")), device="cpu",
                                     dtype="float32")).pipe
    torch.manual_seed(0)
    return pipe, type(pipe.transformer).from_config({**pipe.transformer.config, **overrides}).eval()


def _inputs(transformer, text_dim: int, gen: torch.Generator) -> dict:
    sizes = [SMALL] * ROWS_PER_SIZE + [LARGE] * ROWS_PER_SIZE
    rows = len(sizes)
    return {"sizes": sizes, "timestep": torch.rand(rows, generator=gen),
            "text": torch.randn(rows, TEXT_TOKENS, text_dim, generator=gen)}


def qwen_image_forwards() -> dict[str, Callable[[], object]]:
    from engine_lib.pipelines.qwen_image.mixed_sizes import QwenPacking, packed_forward

    _, t = _transformer("qwen_image", num_layers=6, axes_dims_rope=[16, 24, 24], **WIDE)
    x = _inputs(t, t.config.joint_attention_dim, torch.Generator().manual_seed(0))
    shapes = [(1, h, w) for h, w in x["sizes"]]
    lengths = [h * w for h, w in x["sizes"]]
    latents = torch.randn(len(shapes), max(lengths), t.config.in_channels)
    mask = torch.ones(len(shapes), TEXT_TOKENS, dtype=torch.long)
    packing = QwenPacking(t.pos_embed, shapes, torch.device("cpu"))

    def diffusers(rows: slice, shape: tuple) -> None:
        n = shape[1] * shape[2]  # (frames, h, w)
        t(hidden_states=latents[rows, :n], timestep=x["timestep"][rows], encoder_hidden_states=x["text"][rows],
          encoder_hidden_states_mask=mask[rows], img_shapes=[[shape]] * (rows.stop - rows.start), return_dict=False)

    return _three(lambda: packed_forward(t, latents, x["timestep"], None, x["text"], mask, packing),
                  lambda rows, size: diffusers(rows, (1, *size)))


def flux_forwards() -> dict[str, Callable[[], object]]:
    from diffusers import FluxPipeline

    from engine_lib.pipelines.flux.mixed_sizes import FluxPacking, packed_forward

    _, t = _transformer("flux", num_layers=2, num_single_layers=4, axes_dims_rope=[16, 24, 24], **WIDE)
    x = _inputs(t, t.config.joint_attention_dim, torch.Generator().manual_seed(0))
    img_ids = [FluxPipeline._prepare_latent_image_ids(1, h, w, "cpu", torch.float32) for h, w in x["sizes"]]
    latents = torch.randn(len(img_ids), max(ids.shape[0] for ids in img_ids), t.config.in_channels)
    pooled = torch.randn(len(img_ids), t.config.pooled_projection_dim)
    guidance = torch.full((len(img_ids),), 3.5) if t.config.guidance_embeds else None
    txt_ids = torch.zeros(TEXT_TOKENS, 3)
    packing = FluxPacking(t.pos_embed, txt_ids, img_ids, torch.device("cpu"))

    def diffusers(rows: slice, size: tuple) -> None:
        ids = FluxPipeline._prepare_latent_image_ids(1, *size, "cpu", torch.float32)
        t(hidden_states=latents[rows, :ids.shape[0]], timestep=x["timestep"][rows],
          guidance=None if guidance is None else guidance[rows], pooled_projections=pooled[rows],
          encoder_hidden_states=x["text"][rows], txt_ids=txt_ids, img_ids=ids, return_dict=False)

    return _three(lambda: packed_forward(t, latents, x["timestep"], guidance, pooled, x["text"], packing), diffusers)


def sd3_forwards() -> dict[str, Callable[[], object]]:
    from engine_lib.pipelines.sd3.mixed_sizes import SD3Packing, from_tokens, packed_forward

    _, t = _transformer("sd3", num_layers=6, caption_projection_dim=256, **WIDE)
    x = _inputs(t, t.config.joint_attention_dim, torch.Generator().manual_seed(0))
    patch = t.config.patch_size
    sizes = [(h * patch, w * patch) for h, w in x["sizes"]]  # latent pixels
    latents = torch.randn(len(sizes), max(h * w for h, w in sizes), t.config.in_channels)
    pooled = torch.randn(len(sizes), t.config.pooled_projection_dim)
    timestep = 1000 * x["timestep"]
    packing = SD3Packing(sizes, patch, torch.device("cpu"))

    def diffusers(rows: slice, size: tuple) -> None:
        h, w = size[0] * patch, size[1] * patch
        t(hidden_states=from_tokens(latents[rows, :h * w], h, w), timestep=timestep[rows],
          pooled_projections=pooled[rows], encoder_hidden_states=x["text"][rows], return_dict=False)

    return _three(lambda: packed_forward(t, latents, timestep, pooled, x["text"], packing), diffusers)


def _three(packed: Callable[[], object], diffusers: Callable[[slice, tuple], None]) -> dict[str, Callable[[], object]]:
    small, large, every = slice(0, ROWS_PER_SIZE), slice(ROWS_PER_SIZE, 2 * ROWS_PER_SIZE), slice(0, 2 * ROWS_PER_SIZE)
    return {"packed": packed,
            "per_size": lambda: (diffusers(small, SMALL), diffusers(large, LARGE)),
            "padded": lambda: diffusers(every, LARGE)}


PIPELINES = {"qwen_image": qwen_image_forwards, "flux": flux_forwards, "sd3": sd3_forwards}


def run(repeats: int = 15, log_dir: Optional[Path] = None) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    results = {"kind": "packing", "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(),
               "workload": {"small_tokens": list(SMALL), "large_tokens": list(LARGE), "rows_per_size": ROWS_PER_SIZE,
                            "text_tokens": TEXT_TOKENS, "heads": WIDE, "repeats": repeats, "threads": 1},
               "pipelines": {}}
    try:
        with torch.inference_mode():
            for name, build in PIPELINES.items():
                forwards = build()
                times: dict[str, list[float]] = {kind: [] for kind in forwards}
                for call in forwards.values():
                    call()  # warm-up
                for _ in range(repeats):
                    for kind, call in forwards.items():
                        start = time.perf_counter()
                        call()
                        times[kind].append(time.perf_counter() - start)
                ms = {kind: 1000 * statistics.median(values) for kind, values in times.items()}
                results["pipelines"][name] = {"median_ms": ms, "per_size_over_packed": ms["per_size"] / ms["packed"],
                                              "padded_over_packed": ms["padded"] / ms["packed"]}
    finally:
        torch.set_num_threads(threads)
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    return side_main(__doc__, "packing", run, lambda r: ", ".join(
        f"{name}: per size / packed {e['per_size_over_packed']:.2f}x, padded / packed {e['padded_over_packed']:.2f}x"
        for name, e in r["pipelines"].items()), argv, option=("repeats", 15))


if __name__ == "__main__":
    raise SystemExit(main())
