"""Qwen-Image-Edit: `QwenImageEditPipeline` (the shared adapter of both edit pipelines is here)."""
