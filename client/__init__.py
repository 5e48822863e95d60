"""Client for the diffusion models served by this repository's Triton model repository.

`generate()` returns images, `answer()` a text answer (BAGEL); `stream()` yields Progress events and a Final one.
The CLI is `python -m client generate ...`.
"""

from __future__ import annotations

from client.api import answer, build_inputs, generate, stream
from client.events import (
    ClientError,
    Final,
    Progress,
    RequestTimeoutError,
    ServerError,
    ServerUnreachableError,
)

__all__ = [
    "answer",
    "generate",
    "stream",
    "build_inputs",
    "Progress",
    "Final",
    "ClientError",
    "ServerError",
    "ServerUnreachableError",
    "RequestTimeoutError",
]
