"""Wan image to video (Wan2.1 with its CLIP image encoder, Wan2.2 A14B, Wan2.2 TI2V-5B): `WanImageToVideoPipeline`."""
