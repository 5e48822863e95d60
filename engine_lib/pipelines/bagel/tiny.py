"""Tiny random-weight BAGEL preset in the official checkpoint layout (built offline by `make models`).

The weights follow the procedure the golden set was made with (tests/golden/bagel/README.md,
from the reference implementation's tiny config), so the `tiny` preset is the
golden checkpoint bit for bit (tests/pipelines/test_bagel.py checks the files): per
file, keys in sorted order, one generator (ema: seed, ae: seed + 1), norm scales
`1 + 0.1 * randn`, everything else `0.02 * randn`. The key lists come from our own
model (`BagelModel.official_parameters`, the text head included) and the FLUX
autoencoder layout (`flux_ae_shapes`). The tokenizer files are data copied from the
golden set (a byte-level BPE of 295 merges plus BAGEL's special tokens).
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

TOKENIZER_DIR = Path(__file__).resolve().parent / "tiny_tokenizer"

PRESETS = {
    "tiny": {
        "llm_config": {  # fields of the official llm_config.json, shrunk
            "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 295,
            "eos_token_id": 297, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
            "intermediate_size": 128, "max_position_embeddings": 4096, "max_window_layers": 2, "model_type": "qwen2",
            "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0, "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "float32",
            "use_cache": True, "use_mrope": False, "use_sliding_window": False, "vocab_size": 300,
        },
        "max_latent_size": 16,  # up to 16 patches x 16 px = 256 px per side
        "latent_patch_size": 2,
        "vae": {"ch": 32, "ch_mult": [1, 1, 1, 1], "num_res_blocks": 1, "z_channels": 16},
    },
}


def is_norm_weight(key: str) -> bool:
    parts = key.split(".")
    return parts[-1] == "weight" and "norm" in parts[-2]


def seeded_state(shapes: Mapping[str, tuple], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for key in sorted(shapes):
        x = torch.randn(*shapes[key], generator=generator, dtype=torch.float32)
        state[key] = ((1.0 + 0.1 * x) if is_norm_weight(key) else 0.02 * x).contiguous()
    return state


@dataclass
class BagelCheckpoint:
    """What `make models` writes: the official files (`save_pretrained`, as a diffusers pipeline saves)."""

    llm_config: dict
    ema: dict
    ae: dict

    def set_progress_bar_config(self, **kwargs) -> None:
        """tiny_models calls this on every built pipeline."""

    def save_pretrained(self, folder: str, safe_serialization: bool = True) -> None:
        from safetensors.torch import save_file

        from engine_lib.pipelines.bagel.pipeline import write_llm_config

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        write_llm_config(folder, self.llm_config)
        save_file(self.ema, str(folder / "ema.safetensors"))
        save_file(self.ae, str(folder / "ae.safetensors"))
        for file in sorted(TOKENIZER_DIR.iterdir()):
            shutil.copyfile(file, folder / file.name)


def build(preset: Mapping[str, Any], seed: int) -> BagelCheckpoint:
    from engine_lib.pipelines.bagel.model import BagelConfig, BagelModel
    from engine_lib.pipelines.bagel.vae import AEShape, flux_ae_shapes

    llm, vae = dict(preset["llm_config"]), preset["vae"]
    config = BagelConfig.from_llm_config(llm, max_latent_size=preset["max_latent_size"],
                                         patch_latent_dim=preset["latent_patch_size"] ** 2 * vae["z_channels"])
    with torch.device("meta"):  # shapes only
        shapes = {key: tuple(t.shape) for key, t in BagelModel(config).official_parameters().items()}
    ae_shapes = flux_ae_shapes(AEShape(vae["ch"], tuple(vae["ch_mult"]), vae["num_res_blocks"], vae["z_channels"]))
    assert math.isqrt(shapes["latent_pos_embed.pos_embed"][0]) == preset["max_latent_size"]
    return BagelCheckpoint(llm, seeded_state(shapes, seed), seeded_state(ae_shapes, seed + 1))
