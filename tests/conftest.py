"""Shared fixtures for the whole test suite."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_qwen_dir() -> Path:
    """The tiny random-weight Qwen-Image pipeline, saved under models/ (built once if missing)."""
    from engine_lib.tiny_models import ensure_model

    return ensure_model("qwen_image", "tiny")
