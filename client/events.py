"""What a streaming generation yields, and the errors it can raise.

Plain dataclasses so the CLI (and any caller) can tell progress from the
final result without knowing which protocol carried them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np
from PIL import Image


@dataclass
class Video:
    """A video a response carries: raw uint8 frames [N, F, H, W, 3] and/or mp4 files, with its sound (LTX-2)."""

    frames: Optional[np.ndarray] = None
    mp4: Optional[List[bytes]] = None
    frame_rate: Optional[float] = None
    frame_offset: Optional[int] = None  # chunk responses: the index of the chunk's first frame
    audio: Optional[np.ndarray] = None  # float [N, C, S]
    audio_sample_rate: Optional[int] = None


@dataclass
class Progress:
    """One intermediate response: denoise step `step` of `num_steps` finished (maybe with a preview, or a
    video chunk as it was decoded)."""

    step: int
    num_steps: int
    previews: Optional[List[Image.Image]] = None
    chunk: Optional[Video] = None
    text: Optional[str] = None  # the new characters of a text being decoded (BAGEL's answer or thought)


@dataclass
class Final:
    """The last response of a request: the finished images, or the video; a text answer or thought whole, with
    why it ended (`stop`: its end token, `length`: max_new_tokens)."""

    images: List[Image.Image]
    num_steps: Optional[int] = None
    video: Optional[Video] = None
    text: Optional[str] = None
    finish_reason: Optional[str] = None


class ClientError(Exception):
    """Base of the client's errors; the CLI prints its message without a traceback."""


class ServerError(ClientError):
    """The server answered the request with an error; carries Triton's message."""

    def __init__(self, message: str, status: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.status = status


class ServerUnreachableError(ClientError):
    """No connection to the server (wrong address, server down or gone mid-stream)."""


class RequestTimeoutError(ClientError, TimeoutError):
    """The request did not finish within the client's timeout (it is cancelled)."""


class ResponseFormatError(ClientError, ValueError):
    """A response did not have the outputs this client expects (a model/client mismatch)."""
