"""The edit pipelines' `Qwen2VLProcessor` where transformers cannot build one.

transformers 5 builds a `Qwen2VLProcessor` only with its video processor, which needs
torchvision; the edit pipelines never send video and this project does not install
torchvision. So without it the processor is made from its image processor and tokenizer
alone (the same `__call__` on text and images), saved as those two into the pipeline's
`processor/` folder (the layout of the hub's Qwen-Image-Edit), and loaded from there.
With torchvision, `from_pretrained` loads the real one and none of this runs.
"""

from __future__ import annotations

from typing import Any, Optional
from unittest import mock


def has_video_processor() -> bool:
    """Whether transformers can build Qwen2-VL's video processor (it needs torchvision)."""
    from transformers.utils import is_torchvision_available

    return is_torchvision_available()


def image_only(image_processor: Any, tokenizer: Any):
    """A `Qwen2VLProcessor` without a video processor, that saves its two parts."""
    from transformers import Qwen2VLProcessor

    with mock.patch.object(Qwen2VLProcessor, "check_argument_for_proper_class", lambda self, name, arg: None):
        processor = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None)

    def save_pretrained(folder: str, **kwargs: Any) -> None:  # diffusers' save_pretrained calls it per component
        image_processor.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    processor.save_pretrained = save_pretrained
    return processor


def load(model_path: str) -> Optional[Any]:
    """The processor of an edit pipeline (a folder or a hub id) for `from_pretrained(..., processor=)`, or None
    to let it load its own (transformers can build the real one)."""
    from transformers import Qwen2Tokenizer, Qwen2VLImageProcessor

    if has_video_processor():
        return None
    return image_only(Qwen2VLImageProcessor.from_pretrained(model_path, subfolder="processor"),
                      Qwen2Tokenizer.from_pretrained(model_path, subfolder="processor"))
