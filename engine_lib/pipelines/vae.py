"""The VAE helper video pipelines share."""

from __future__ import annotations

from typing import Any

import torch


def video_vae_stats(vae: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The pipeline's VAE de-normalisation constants `latents_mean` and `1 / latents_std` [1, z, 1, 1, 1],
    made as the pipeline makes them, for the device once: made per decode, each would be a host-to-device
    copy that waits."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(device, vae.dtype)
    return mean, 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(device, vae.dtype)
