"""Turn one Triton response (outputs by name) into a Progress or Final event.

Shared by the gRPC and HTTP transports: both hand over a mapping from output
name to a numpy array (gRPC) or a JSON value (HTTP generate_stream).
"""

from __future__ import annotations

import base64
import io
from typing import Any, List, Mapping, Optional, Union

import numpy as np
from PIL import Image

from client.events import Final, Progress, ResponseFormatError, Video

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _scalar(value: Any) -> Any:
    """A [1]-shaped output as a Python scalar (numpy array or JSON list or plain value)."""
    if value is None:
        return None
    arr = np.asarray(value)
    return arr.reshape(-1)[0].item() if arr.size else None


def _png_bytes(item: Union[bytes, str]) -> bytes:
    """One `image_png` element: raw PNG bytes, or base64 text (how JSON carries bytes)."""
    if isinstance(item, str):
        item = item.encode("ascii")
    if item.startswith(PNG_MAGIC):
        return item
    return base64.b64decode(item)


def decode_images(outputs: Mapping[str, Any]) -> Optional[List[Image.Image]]:
    """Images carried by a response, from `image_png` (preferred) or raw `image`; None if none."""
    png = outputs.get("image_png")
    if png is not None:
        items = [png] if isinstance(png, (bytes, str)) else list(np.asarray(png, dtype=object).reshape(-1))
        if items:
            return [Image.open(io.BytesIO(_png_bytes(item))).convert("RGB") for item in items]
    raw = outputs.get("image")
    if raw is not None:
        arr = np.asarray(raw, dtype=np.uint8)
        if arr.ndim == 3:  # a single image without the batch axis
            arr = arr[None]
        if arr.ndim != 4 or arr.shape[-1] != 3:
            raise ResponseFormatError(f"output 'image' has shape {arr.shape}, expected [N, H, W, 3]")
        return [Image.fromarray(np.ascontiguousarray(a)) for a in arr]
    return None


def decode_video(outputs: Mapping[str, Any]) -> Optional[Video]:
    """The video a response carries (raw `video` and/or base64 `video_mp4`, frame rate, offset, audio);
    None if none."""
    raw, mp4 = outputs.get("video"), outputs.get("video_mp4")
    if raw is None and mp4 is None:
        return None
    frames = None
    if raw is not None:
        frames = np.asarray(raw, dtype=np.uint8)
        if frames.ndim != 5 or frames.shape[-1] != 3:
            raise ResponseFormatError(f"output 'video' has shape {frames.shape}, expected [N, F, H, W, 3]")
    files = None
    if mp4 is not None:
        items = [mp4] if isinstance(mp4, (bytes, str)) else list(np.asarray(mp4, dtype=object).reshape(-1))
        files = [base64.b64decode(item) for item in items]
    audio = outputs.get("audio")
    rate, offset, sample_rate = (_scalar(outputs.get(name)) for name in ("frame_rate", "frame_offset",
                                                                          "audio_sample_rate"))
    return Video(frames=frames, mp4=files, frame_rate=rate, audio=None if audio is None else np.asarray(audio, np.float32),
                 frame_offset=None if offset is None else int(offset),
                 audio_sample_rate=None if sample_rate is None else int(sample_rate))


def _text(value: Any) -> Optional[str]:
    """A [1] text output (gRPC: UTF-8 bytes, HTTP: a JSON string) as str; None if absent."""
    if value is None:
        return None
    if not isinstance(value, (bytes, str)):
        items = np.asarray(value, dtype=object).reshape(-1)
        value = items[0] if items.size else ""
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def decode_response(outputs: Mapping[str, Any], is_last: bool) -> Union[Progress, Final, None]:
    """The event for one response. `is_last`: the transport saw Triton's final flag.

    A response is final when its `is_final` output says so or it is the last one
    on the stream; a flags-only last response (no outputs) yields None, and the
    caller uses the images it already has.
    """
    images = decode_images(outputs)
    video = decode_video(outputs)
    step = _scalar(outputs.get("step"))
    num_steps = _scalar(outputs.get("num_steps"))
    text = _text(outputs.get("text"))
    if bool(_scalar(outputs.get("is_final"))) or (is_last and (images is not None or video is not None
                                                               or text is not None)):
        if images is None and video is None and text is None:
            raise ResponseFormatError("the final response carries no image, video or text")
        return Final(images=images or [], num_steps=num_steps, video=video, text=text,
                     finish_reason=_text(outputs.get("finish_reason")))
    if step is None and images is None and video is None and text is None:
        return None
    return Progress(step=int(step or 0), num_steps=int(num_steps or 0), previews=images, chunk=video, text=text)
