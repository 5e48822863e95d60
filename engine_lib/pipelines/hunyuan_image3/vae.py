"""HunyuanImage-3.0's VAE decoder (the reference's `AutoencoderKLConv3D`), our own code.

diffusers 0.42 has no equivalent: its HunyuanImage refiner and HunyuanVideo 1.5
autoencoders use causal convolutions and RMS norms, this one symmetric 3D
convolutions and GroupNorm. Only the decoder is built (the encoder conditions on
images, which text to image does not do). Its upsamplers are DC-AE style: a conv
to `factor` times the channels folded into space (and time), plus the input
repeated the same way. A single image is one latent frame; the decoder grows time
too, and the last frame is the image (as the reference's `decode`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _fold(x: torch.Tensor, r1: int) -> torch.Tensor:
    """'b (r1 r2 r3 c) f h w -> b c (f r1) (h r2) (w r3)' with r2 = r3 = 2."""
    b, channels, f, h, w = x.shape
    c = channels // (r1 * 4)
    x = x.view(b, r1, 2, 2, c, f, h, w).permute(0, 4, 5, 1, 6, 2, 7, 3)
    return x.reshape(b, c, f * r1, h * 2, w * 2)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(32, cin, eps=1e-6)
        self.conv1 = nn.Conv3d(cin, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(32, cout, eps=1e-6)
        self.conv2 = nn.Conv3d(cout, cout, 3, padding=1)
        if cin != cout:
            self.nin_shortcut = nn.Conv3d(cin, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x) + h


class AttnBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.norm = nn.GroupNorm(32, channels, eps=1e-6)
        self.q, self.k, self.v, self.proj_out = (nn.Conv3d(channels, channels, 1) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        b, c, f, hh, w = x.shape
        q, k, v = (m(h).flatten(2).transpose(1, 2)[:, None] for m in (self.q, self.k, self.v))  # b 1 (f h w) c
        out = F.scaled_dot_product_attention(q, k, v)[:, 0].transpose(1, 2).reshape(b, c, f, hh, w)
        return x + self.proj_out(out)


class UpsampleDCAE(nn.Module):
    def __init__(self, cin: int, cout: int, temporal: bool):
        super().__init__()
        self.r1 = 2 if temporal else 1
        self.conv = nn.Conv3d(cin, cout * self.r1 * 4, 3, padding=1)
        self.repeats = self.r1 * 4 * cout // cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _fold(self.conv(x), self.r1) + _fold(x.repeat_interleave(self.repeats, dim=1), self.r1)


class Decoder(nn.Module):
    """Under the checkpoint's names (`vae.decoder.up.0.block.1.conv1`, ...)."""

    def __init__(self, z_channels: int, out_channels: int, block_out_channels: list[int], num_res_blocks: int,
                 ffactor_spatial: int, ffactor_temporal: int):
        super().__init__()
        self.z_channels, self.block_out_channels = z_channels, block_out_channels
        block_in = block_out_channels[0]
        self.conv_in = nn.Conv3d(z_channels, block_in, 3, padding=1)
        self.mid = nn.Module()
        self.mid.block_1 = ResnetBlock(block_in, block_in)
        self.mid.attn_1 = AttnBlock(block_in)
        self.mid.block_2 = ResnetBlock(block_in, block_in)
        self.up = nn.ModuleList()
        for level, channels in enumerate(block_out_channels):
            up = nn.Module()
            up.block = nn.ModuleList()
            for _ in range(num_res_blocks + 1):
                up.block.append(ResnetBlock(block_in, channels))
                block_in = channels
            spatial, temporal = level < math.log2(ffactor_spatial), level < math.log2(ffactor_temporal)
            if spatial or temporal:
                block_out = block_out_channels[level + 1]
                up.upsample = UpsampleDCAE(block_in, block_out, temporal)
                block_in = block_out
            self.up.append(up)
        self.norm_out = nn.GroupNorm(32, block_in, eps=1e-6)
        self.conv_out = nn.Conv3d(block_in, out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z) + z.repeat_interleave(self.block_out_channels[0] // self.z_channels, dim=1)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for up in self.up:
            for block in up.block:
                h = block(h)
            if hasattr(up, "upsample"):
                h = up.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class VAE(nn.Module):
    """The decoder and the latent scale of the checkpoint's `vae` config."""

    def __init__(self, config: dict):
        super().__init__()
        for key in ("downsample_match_channel", "upsample_match_channel"):
            if not config.get(key, True):
                raise ValueError(f"config.json: vae.{key}=false is not supported")
        self.scaling_factor = float(config["scaling_factor"])
        self.shift_factor = float(config.get("shift_factor") or 0.0)
        self.decoder = Decoder(config["latent_channels"], config["out_channels"],
                               list(reversed(config["block_out_channels"])), config["layers_per_block"],
                               config["ffactor_spatial"], config["ffactor_temporal"])

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """[N, C, h, w] latents -> [N, 3, H, W] raw decoder output (one frame: the last one the decoder makes)."""
        z = (latents / self.scaling_factor + self.shift_factor).unsqueeze(2).to(self.decoder.conv_in.weight.dtype)
        return self.decoder(z)[:, :, -1].float()
