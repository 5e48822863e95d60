"""Qwen-Image-Edit-Plus: `QwenImageEditPlusPipeline`, several input images (the adapter is qwen_image_edit's)."""
