"""BAGEL's VAE: the FLUX autoencoder, as diffusers' `AutoencoderKL` loaded from the FLUX `ae.safetensors` layout.

BAGEL ships the FLUX `ae.safetensors` (original key names: `decoder.up.0.block.1.conv1`,
`decoder.mid.attn_1.q`, ...) and hard-codes its shape in the reference's `load_ae`.
diffusers' `AutoencoderKL` is that architecture, and diffusers' own single-file
converter (`convert_ldm_vae_checkpoint`) maps the layout exactly, so we reuse both.
The shape (channels, levels, blocks, latent channels) is read from the tensors, and
the file must hold exactly the keys of that shape (`flux_ae_shapes`), so a missing
or extra key fails the load naming it. Scale and shift are FLUX's, as in the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine_lib.pipelines.checkpoint import check_keys

SCALE_FACTOR, SHIFT_FACTOR = 0.3611, 0.1159  # the reference's load_ae (FLUX's autoencoder)


@dataclass(frozen=True)
class AEShape:
    ch: int
    ch_mult: tuple[int, ...]
    num_res_blocks: int
    z_channels: int
    in_channels: int = 3
    out_ch: int = 3

    @classmethod
    def of(cls, state: dict[str, torch.Tensor]) -> "AEShape":
        """Read from the tensors (every FLUX-layout autoencoder has these keys)."""
        for key in ("encoder.conv_in.weight", "decoder.conv_in.weight", "decoder.conv_out.weight"):
            if key not in state:
                raise ValueError(f"ae.safetensors: missing key {key!r}")
        ch = int(state["encoder.conv_in.weight"].shape[0])
        levels = sorted({int(k.split(".")[2]) for k in state if k.startswith("encoder.down.")})
        blocks = {int(k.split(".")[4]) for k in state if k.startswith("encoder.down.0.block.")}
        mult = tuple(int(state[f"encoder.down.{i}.block.0.conv1.weight"].shape[0]) // ch for i in levels)
        return cls(ch=ch, ch_mult=mult, num_res_blocks=len(blocks),
                   z_channels=int(state["decoder.conv_in.weight"].shape[1]),
                   in_channels=int(state["encoder.conv_in.weight"].shape[1]),
                   out_ch=int(state["decoder.conv_out.weight"].shape[0]))

    def diffusers_config(self) -> dict:
        levels = len(self.ch_mult)
        return dict(in_channels=self.in_channels, out_channels=self.out_ch,
                    down_block_types=("DownEncoderBlock2D",) * levels, up_block_types=("UpDecoderBlock2D",) * levels,
                    block_out_channels=tuple(self.ch * m for m in self.ch_mult), layers_per_block=self.num_res_blocks,
                    latent_channels=self.z_channels, norm_num_groups=32, scaling_factor=SCALE_FACTOR,
                    shift_factor=SHIFT_FACTOR, use_quant_conv=False, use_post_quant_conv=False)


def flux_ae_shapes(shape: AEShape) -> dict[str, tuple[int, ...]]:
    """Every key of a FLUX-layout `ae.safetensors` of this shape, with its tensor shape (the reference's
    Encoder/Decoder modules: resnet blocks with nin_shortcut where channels change, one mid attention)."""
    keys: dict[str, tuple[int, ...]] = {}

    def conv(name, cin, cout, k=3):
        keys[f"{name}.weight"], keys[f"{name}.bias"] = (cout, cin, k, k), (cout,)

    def norm(name, c):
        keys[f"{name}.weight"], keys[f"{name}.bias"] = (c,), (c,)

    def resnet(name, cin, cout):
        norm(f"{name}.norm1", cin)
        conv(f"{name}.conv1", cin, cout)
        norm(f"{name}.norm2", cout)
        conv(f"{name}.conv2", cout, cout)
        if cin != cout:
            conv(f"{name}.nin_shortcut", cin, cout, 1)

    def mid(prefix, c):
        resnet(f"{prefix}.mid.block_1", c, c)
        norm(f"{prefix}.mid.attn_1.norm", c)
        for part in ("q", "k", "v", "proj_out"):
            conv(f"{prefix}.mid.attn_1.{part}", c, c, 1)
        resnet(f"{prefix}.mid.block_2", c, c)

    ch, mult, levels = shape.ch, shape.ch_mult, len(shape.ch_mult)
    conv("encoder.conv_in", shape.in_channels, ch)
    block_in = ch
    for i in range(levels):
        for j in range(shape.num_res_blocks):
            resnet(f"encoder.down.{i}.block.{j}", block_in, ch * mult[i])
            block_in = ch * mult[i]
        if i != levels - 1:
            conv(f"encoder.down.{i}.downsample.conv", block_in, block_in)
    mid("encoder", block_in)
    norm("encoder.norm_out", block_in)
    conv("encoder.conv_out", block_in, 2 * shape.z_channels)

    block_in = ch * mult[-1]
    conv("decoder.conv_in", shape.z_channels, block_in)
    mid("decoder", block_in)
    for i in reversed(range(levels)):
        for j in range(shape.num_res_blocks + 1):
            resnet(f"decoder.up.{i}.block.{j}", block_in, ch * mult[i])
            block_in = ch * mult[i]
        if i != 0:
            conv(f"decoder.up.{i}.upsample.conv", block_in, block_in)
    norm("decoder.norm_out", block_in)
    conv("decoder.conv_out", block_in, shape.out_ch)
    return keys


def load_vae(model_path: Path, device: torch.device, dtype: torch.dtype):
    """`ae.safetensors` as a diffusers AutoencoderKL; the file must hold exactly the keys of its shape."""
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    from safetensors.torch import load_file

    state = load_file(str(Path(model_path) / "ae.safetensors"))
    shape = AEShape.of(state)
    check_keys("ae.safetensors", state, flux_ae_shapes(shape))
    config = shape.diffusers_config()
    vae = AutoencoderKL(**config)
    vae.load_state_dict(convert_ldm_vae_checkpoint(state, config), strict=True)
    vae.to(device)
    return (vae if dtype == torch.float32 else vae.to(dtype)).eval()  # (a dtype cast warns, even to float32)


@torch.no_grad()
def decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """[N, C, h, w] latents -> [N, 3, H, W] raw decoder output: the reference's `decoder(z / scale + shift)`."""
    config = vae.config
    z = latents.to(vae.dtype) / config.scaling_factor + config.shift_factor
    return vae.decode(z, return_dict=False)[0].float()
