"""Tiny random-weight `FluxKontextPipeline` preset (built offline by `make models`): Flux's tiny components.

FLUX.1 Kontext is FLUX.1's architecture with another checkpoint, so the tiny model is Flux's, saved as
`FluxKontextPipeline` (its own model_index.json and model folder).
"""

from __future__ import annotations

from typing import Any, Mapping

from engine_lib.pipelines.flux import tiny as flux_tiny

PRESETS = flux_tiny.PRESETS


def build(preset: Mapping[str, Any], seed: int):
    """Flux's tiny pipeline of one preset, as a `FluxKontextPipeline`."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**flux_tiny.build(preset, seed).components)
