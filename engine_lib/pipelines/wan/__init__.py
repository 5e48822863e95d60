"""Wan text to video (Wan2.1, Wan2.2 A14B with its two experts, Wan2.2 TI2V-5B): `WanPipeline`."""
