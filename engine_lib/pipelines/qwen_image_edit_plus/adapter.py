"""`QwenImageEditPlusPipeline` (engine_lib/pipelines/qwen_image_edit/adapter.py holds both edit adapters)."""

from engine_lib.pipelines.qwen_image_edit.adapter import QwenImageEditPlusAdapter

ADAPTER = QwenImageEditPlusAdapter
