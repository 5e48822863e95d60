"""The FLUX.2 [klein] releases' component configs, and what their weights cost (docs/deployment.md's numbers).

`python -m engine_lib.pipelines.flux2.releases` builds each release's transformer, Qwen3 text encoder and
VAE from their published configs on the meta device, counts their parameters and prints their bfloat16
sizes. The base and the step-distilled checkpoint of a size share these shapes.
"""

from __future__ import annotations

from engine_lib.pipelines.release_sizes import parameters, print_sizes
from engine_lib.pipelines.z_image.releases import QWEN3_4B

KLEIN = dict(in_channels=128, attention_head_dim=128, guidance_embeds=False)
RELEASES = {  # transformer config, Qwen3 text encoder config (a causal LM: the 8B's head is not tied)
    "FLUX.2-klein-4B": (dict(KLEIN, num_layers=5, num_single_layers=20, num_attention_heads=24,
                             joint_attention_dim=3 * 2560), QWEN3_4B),
    "FLUX.2-klein-9B": (dict(KLEIN, num_layers=8, num_single_layers=24, num_attention_heads=32,
                             joint_attention_dim=3 * 4096),
                        dict(QWEN3_4B, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)),
}


def sizes() -> dict[str, dict[str, int]]:
    """Release -> component -> parameters."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vae = parameters(AutoencoderKLFlux2)
    return {name: {"transformer": parameters(lambda: Flux2Transformer2DModel(**transformer)),
                   "text_encoder (Qwen3)": parameters(lambda: Qwen3ForCausalLM(Qwen3Config(**text))),
                   "vae (FLUX.2)": vae}
            for name, (transformer, text) in RELEASES.items()}


if __name__ == "__main__":
    for release, parts in sizes().items():
        print_sizes(release, parts)
