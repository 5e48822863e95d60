"""Tiny random-weight HunyuanImage-3.0 preset in the official layout (built offline by `make models`).

The weights follow the procedure the golden set was made with (tests/golden/hunyuan_image3/README.md,
from the reference implementation's tiny config), so the `tiny` preset is the golden
checkpoint bit for bit (tests/pipelines/test_hunyuan_image3.py checks the file's hash):
keys in sorted order, one generator seeded with the seed, norm scales (GroupNorm,
LayerNorm, RMSNorm weights) `1 + 0.1 * randn`, everything else `0.02 * randn`. The
generation keys and shapes come from our own model; the understanding-only ones we
never load (ViT, aligner, VAE encoder, text head), the tiny `config.json` and the
tokenizer files are data copied from the golden set (`tiny_data/`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

DATA = Path(__file__).resolve().parent / "tiny_data"
PRESETS = {"tiny": {"config": "tiny_data/config.json"}}


@dataclass
class HunyuanCheckpoint:
    """What `make models` writes: `config.json`, `model.safetensors`, `tokenizer/` (as a pipeline saves)."""

    state: dict

    def set_progress_bar_config(self, **kwargs) -> None:
        """tiny_models calls this on every built pipeline."""

    def save_pretrained(self, folder: str, safe_serialization: bool = True) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(DATA / "config.json", folder / "config.json")
        save_file(self.state, str(folder / "model.safetensors"))
        shutil.copytree(DATA / "tokenizer", folder / "tokenizer", dirs_exist_ok=True)


def build(preset: Mapping[str, Any], seed: int) -> HunyuanCheckpoint:
    from engine_lib.pipelines.hunyuan_image3.model import HunyuanConfig, HunyuanImage3Model
    from engine_lib.pipelines.hunyuan_image3.vae import VAE
    from engine_lib.pipelines.decoder_parts import RMSNorm

    config = HunyuanConfig.from_json(json.loads((DATA / "config.json").read_text()))
    with torch.device("meta"):  # shapes only
        parts = {"": HunyuanImage3Model(config), "vae.decoder.": VAE(config.vae).decoder}
    shapes, norms = {}, set()
    for prefix, module in parts.items():
        shapes.update({prefix + k: tuple(t.shape) for k, t in module.state_dict().items()})
        norms |= {f"{prefix}{name}.weight" for name, m in module.named_modules()
                  if isinstance(m, (nn.GroupNorm, nn.LayerNorm, RMSNorm))}
    for key, entry in json.loads((DATA / "understanding_keys.json").read_text()).items():
        shapes[key] = tuple(entry["shape"])
        if entry["norm"]:
            norms.add(key)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for key in sorted(shapes):
        x = torch.randn(*shapes[key], generator=generator, dtype=torch.float32)
        state[key] = ((1.0 + 0.1 * x) if key in norms else 0.02 * x).contiguous()
    return HunyuanCheckpoint(state)
