"""Helios' context-parallel plan (sequence parallel: video_sequence_parallel.py), fitted to the checkpoint.

diffusers' `HeliosTransformer3DModel._cp_plan` splits the tokens (history and chunk) at each block's
self-attention, cross-attention and feed-forward and gathers them after each; it names the gathers of blocks 0
to 39, and a checkpoint with fewer blocks has no module for the rest: those entries are left out.
"""

from __future__ import annotations


def plan(transformer) -> dict:
    blocks = len(transformer.blocks)

    def present(name: str) -> bool:
        parts = name.split(".")
        return not (parts[0] == "blocks" and parts[1].isdigit() and int(parts[1]) >= blocks)

    return {name: entry for name, entry in transformer._cp_plan.items() if present(name)}
