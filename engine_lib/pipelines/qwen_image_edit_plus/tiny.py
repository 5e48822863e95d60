"""Tiny random-weight `QwenImageEditPlusPipeline` presets: Qwen-Image-Edit's (qwen_image_edit/tiny.py)."""

from __future__ import annotations

from typing import Any, Mapping

from engine_lib.pipelines.qwen_image_edit import tiny as edit_tiny

PRESETS = edit_tiny.PRESETS


def build(preset: Mapping[str, Any], seed: int):
    return edit_tiny.build(preset, seed, pipeline_class="QwenImageEditPlusPipeline")
