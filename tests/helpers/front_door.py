"""A real front door (`OpenAIFrontDoor`) in front of a test's tritonserver, the OpenAI SDK pointed at it, and the
PNGs it answers decoded."""

from __future__ import annotations

import base64
import io
import os

import numpy as np
import openai
from PIL import Image

from engine_lib.serving.processes import OpenAIFrontDoor, free_port


def front_door(triton_url: str, tmp_path, **env) -> OpenAIFrontDoor:
    """A started front door in front of `triton_url`, with `env` added to this process's environment."""
    return OpenAIFrontDoor(triton_url, port=free_port(), log_path=tmp_path / "openai.log",
                           env={**os.environ, **env}).start()


def sdk(door: OpenAIFrontDoor, api_key: str = "unused") -> openai.OpenAI:
    """The OpenAI SDK pointed at `door`, without retries (a test counts every request)."""
    return openai.OpenAI(api_key=api_key, base_url=f"{door.url}/v1", max_retries=0, timeout=120)


def decode(b64: str) -> np.ndarray:
    """A base64 PNG from the front door, as an array."""
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    return np.asarray(image)
