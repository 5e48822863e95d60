"""`HunyuanImage3Pipeline`: HunyuanImage-3.0 text to image in the shape of a diffusers pipeline.

The reference's `generate_image(prompt, seed, image_size, diff_guidance_scale,
diff_infer_steps)` cut into the pieces the engine's step contract needs, used
both by `__call__` (one request, the reference's loop) and by the adapter:

* `sizes`: the reference's resolution buckets around `image_base_size` (the
  aspect ratio picks `<img_ratio_i>`); an image is h x w tokens of 16 px;
* `encode`: the "pretrain" template without a system prompt: `<|startoftext|>`,
  the prompt tokens, `<boi>`, `<img_size_B>`, `<img_ratio_i>` prefilled into the
  request's own cache; the unconditional context is the same with every prompt
  token replaced by `<cfg>`. The `<timestep>` and image tokens that follow are
  re-run every step (`<eoi>` after them is never attended to, so it is left out);
* `initial_noise`: `torch.randn([C, h, w])` from a CPU generator seeded with the seed;
* the schedule: sigmas `linspace(1, 0, k + 1)` shifted by `flow_shift`, model
  timesteps `sigma * 1000`, Euler `x + (sigma_next - sigma) * pred`;
* CFG `uncond + s (cond - uncond)` when `guidance_scale > 1`; otherwise the
  conditional pass alone (the reference crashes there);
* `decode`: `latents / scaling_factor`, the VAE's last frame, diffusers'
  postprocess `(x / 2 + 0.5).clamp(0, 1)` (the engine rounds to uint8).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence

import numpy as np
import torch

from engine_lib.pipelines.hunyuan_image3.model import (HunyuanConfig, HunyuanImage3Model, ImageRows, read_config,
                                                      read_weights)
from engine_lib.pipelines.hunyuan_image3.vae import VAE
from engine_lib.pipelines.decoder_parts import KVCache, shifted_schedule

# The reference repository has no generation_config.json; these are the golden set's settings, used when the
# model folder has none (the official release ships one: its values win).
GENERATION_DEFAULTS = {"diff_infer_steps": 4, "diff_guidance_scale": 5.0, "flow_shift": 3.0}


def resolution_buckets(base: int) -> list[tuple[int, int]]:
    """The reference's `ResolutionGroup(base)`: (height, width) from base/2 to 2*base in steps of base/16,
    sorted by height / width; the index is the `<img_ratio_i>` token."""
    step, low, high = base // 16, base // 2, base * 2
    sizes = [(base, base)]
    h, w = base, base
    while not (h >= high and w <= low):
        h, w = min(h + step, high), max(w - step, low)
        sizes.append((h, w))
    h, w = base, base
    while not (h <= low and w >= high):
        h, w = max(h - step, low), min(w + step, high)
        sizes.append((h, w))
    return sorted(sizes, key=lambda s: s[0] / s[1])


@dataclass
class Context:
    """A request's prompt contexts and image shape."""

    cond: KVCache
    uncond: Optional[KVCache]  # None without CFG
    grid: tuple[int, int]  # image tokens (h, w)


class HunyuanImage3Pipeline:
    def __init__(self, model: HunyuanImage3Model, vae: VAE, tokenizer, generation: dict, device: torch.device):
        self.model, self.vae, self.tokenizer, self.device = model, vae, tokenizer, torch.device(device)
        self.generation = {**GENERATION_DEFAULTS, **{k: generation[k] for k in GENERATION_DEFAULTS if k in generation}}
        c = model.config
        self.token_size = c.vae_downsample  # pixels per image token (patch size 1)
        self.buckets = resolution_buckets(c.image_base_size)
        self.ratios = np.array([h / w for h, w in self.buckets])
        names = ["<|startoftext|>", "<boi>", f"<img_size_{c.image_base_size}>", "<cfg>"]
        ids = [tokenizer.convert_tokens_to_ids(t) for t in names]
        if any(i is None or i == tokenizer.unk_token_id for i in ids):
            raise ValueError(f"the tokenizer lacks HunyuanImage-3's special tokens {names}")
        self.bos, self.boi, self.img_size, self.cfg = ids
        self.ratio_tokens = [tokenizer.convert_tokens_to_ids(f"<img_ratio_{i}>") for i in range(len(self.buckets))]

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32, device: str = "cpu", model=None):
        """`model`: what stands in for the transformer (tensor_parallel.RankedModel: the ranks hold it); then only
        the VAE decoder's weights are read here."""
        from transformers import AutoTokenizer

        folder = Path(path)
        config = HunyuanConfig.from_json(read_config(folder))
        vae = VAE(config.vae)
        if model is None:
            model = HunyuanImage3Model(config)
            model.load_official(read_weights(folder), vae)
        else:
            vae.decoder.load_state_dict(read_weights(folder, prefix="vae.decoder."), strict=True)
        tokenizer_dir = folder / "tokenizer" if (folder / "tokenizer").is_dir() else folder
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        generation_file = folder / "generation_config.json"
        generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
        device = torch.device(device)
        return cls(model.to(device=device, dtype=dtype).eval(), vae.to(device=device, dtype=dtype).eval(),
                   tokenizer, generation, device)

    def to(self, device) -> "HunyuanImage3Pipeline":
        self.device = torch.device(device)
        self.model.to(self.device)
        self.vae.to(self.device)
        return self

    def set_progress_bar_config(self, **kwargs) -> None:
        """diffusers' pipeline API; this pipeline draws no progress bar."""

    # -- sizes --------------------------------------------------------------------------------
    def bucket(self, height: int, width: int) -> int:
        """The ratio index the reference picks for a requested size."""
        return int(np.argmin(np.abs(self.ratios - height / width)))

    def snapped_size(self, height: int, width: int) -> tuple[int, int]:
        """The size the reference generates for a requested one (its bucket, in whole tokens)."""
        h, w = self.buckets[self.bucket(height, width)]
        return h // self.token_size * self.token_size, w // self.token_size * self.token_size

    def sizes(self) -> list[tuple[int, int]]:
        """Every size this model generates as asked (height, width)."""
        snapped = {(h // self.token_size * self.token_size, w // self.token_size * self.token_size)
                   for h, w in self.buckets if h >= self.token_size and w >= self.token_size}
        return sorted(size for size in snapped if self.snapped_size(*size) == size)

    # -- the pieces ---------------------------------------------------------------------------
    def prefix_ids(self, prompt: str, height: int, width: int, uncond: bool = False) -> list[int]:
        """The text part of the reference's sequence: bos, prompt (or as many `<cfg>`), `<boi>`, size, ratio."""
        text = self.tokenizer.encode(prompt, add_special_tokens=False)
        if uncond:
            text = [self.cfg] * len(text)
        return [self.bos, *text, self.boi, self.img_size, self.ratio_tokens[self.bucket(height, width)]]

    @torch.no_grad()
    def encode(self, prompt: str, height: int, width: int, cfg: bool) -> Context:
        def prefill(uncond: bool) -> KVCache:
            ids = torch.tensor(self.prefix_ids(prompt, height, width, uncond), device=self.device)
            return self.model.prefill(ids)

        return Context(prefill(False), prefill(True) if cfg else None,
                       (height // self.token_size, width // self.token_size))

    def initial_noise(self, seed: int, context: Context) -> torch.Tensor:
        generator = torch.Generator().manual_seed(int(seed))
        return torch.randn(self.model.config.latent_channels, *context.grid, generator=generator).to(self.device)

    @staticmethod
    def sigmas(num_inference_steps: int, flow_shift: float) -> torch.Tensor:
        return shifted_schedule(num_inference_steps, flow_shift)

    @staticmethod
    def rows_of(contexts: Sequence[Context]) -> list[tuple[KVCache, tuple[int, int]]]:
        """A forward's rows: every request's conditional row, then the unconditional ones of those with CFG."""
        return ([(c.cond, c.grid) for c in contexts] +
                [(c.uncond, c.grid) for c in contexts if c.uncond is not None])

    def image_rows(self, contexts: Sequence[Context]) -> ImageRows:
        """The forward's rows for `contexts`, as `predict` takes them (the same while the batch is)."""
        caches, grids = zip(*self.rows_of(contexts))
        return self.model.image_rows(list(caches), list(grids))

    @torch.no_grad()
    def predict(self, contexts: Sequence[Context], latents: Sequence[torch.Tensor], sigmas: Sequence[torch.Tensor],
                scales: Sequence[float], rows: Optional[ImageRows] = None,
                groups: Optional[list] = None) -> list[torch.Tensor]:
        """One forward over every request's conditional row and, with CFG, its unconditional row; the guided
        prediction [C, h, w] per request. `rows`: `image_rows(contexts)`, made here if not given (`groups`: the
        first-block cache's, per row)."""
        cfg = [i for i, c in enumerate(contexts) if c.uncond is not None]
        rows = rows or self.image_rows(contexts)
        t = torch.stack([sigmas[i] for i in list(range(len(contexts))) + cfg]).to(self.device) * 1000
        raw = self.model.predict(rows, list(latents) + [latents[i] for i in cfg], t.float(), groups)
        out = raw[:len(contexts)]
        for k, i in enumerate(cfg):
            uncond = raw[len(contexts) + k]
            out[i] = uncond + scales[i] * (out[i] - uncond)
        return out

    @torch.no_grad()
    def decode(self, latents: Sequence[torch.Tensor]) -> torch.Tensor:
        """Latents [C, h, w] of one size -> float images [B, H, W, 3] in [0, 1], on the device."""
        images = self.vae.decode(torch.stack(list(latents)))
        return (images / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1)

    # -- the reference's loop, for one request --------------------------------------------------
    def __call__(self, prompt: str, height: int = 1024, width: int = 1024, num_inference_steps: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, guidance_scale: Optional[float] = None,
                 flow_shift: Optional[float] = None, output_type: str = "np"):
        assert output_type == "np", "HunyuanImage3Pipeline returns numpy images"
        steps = num_inference_steps or self.generation["diff_infer_steps"]
        scale = self.generation["diff_guidance_scale"] if guidance_scale is None else guidance_scale
        shift = self.generation["flow_shift"] if flow_shift is None else flow_shift
        seed = generator.initial_seed() if generator is not None else torch.seed()
        context = self.encode(prompt, height, width, cfg=scale > 1.0)
        x = self.initial_noise(seed, context)
        sigmas = self.sigmas(steps, shift)
        for i in range(steps):
            [pred] = self.predict([context], [x], [sigmas[i]], [scale])
            x = x + pred * (sigmas[i + 1] - sigmas[i])
        return SimpleNamespace(images=self.decode([x]).cpu().numpy())
