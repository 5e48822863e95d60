"""Shared fixtures for the whole test suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# One torch thread per process: the tests run pytest and tritonserver's stub side by
# side on 2 cores, where 2 threads each oversubscribe the CPU (measured: a tiny Flux
# call 2.8 s with 2 threads under load, 0.05 s with 1). Set before torch is imported;
# servers started by the tests inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_qwen_dir() -> Path:
    """The tiny random-weight Qwen-Image pipeline, saved under models/ (built once if missing)."""
    from engine_lib.tiny_models import ensure_model

    return ensure_model("qwen_image", "tiny")
