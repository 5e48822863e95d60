"""Checking an official checkpoint against our own model code, key by key (BAGEL, HunyuanImage-3.0).

A checkpoint of a model we wrote ourselves must hold exactly the tensors our modules
expect, under the official names and shapes; understanding-only parts (vision
towers, text heads) are known by prefix and skipped with one log line. Anything
else fails the load naming the key, so a wrong or truncated download never loads
half-initialised.
"""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

import torch


def check_keys(label: str, state: Mapping[str, torch.Tensor], expected: Mapping[str, Sequence[int]],
               skip_prefixes: Sequence[str] = (), logger: logging.Logger | None = None) -> None:
    """Raise ValueError naming the first missing, unexpected or misshapen key of `state` (from `label`).

    `expected`: key -> shape. Keys starting with one of `skip_prefixes` are allowed and logged once,
    grouped by their first one or two name parts.
    """
    skipped = sorted(k for k in state if k not in expected and k.startswith(tuple(skip_prefixes)))
    extra = sorted(k for k in state if k not in expected and k not in skipped)
    missing = sorted(k for k in expected if k not in state)
    if missing:
        raise ValueError(f"{label}: missing key {missing[0]!r}")
    if extra:
        raise ValueError(f"{label}: unexpected key {extra[0]!r}")
    for key, shape in expected.items():
        if tuple(state[key].shape) != tuple(shape):
            raise ValueError(f"{label}: key {key!r} has shape {list(state[key].shape)}, expected {list(shape)}")
    if skipped and logger is not None:
        parts = sorted({next(p for p in skip_prefixes if k.startswith(p)).rstrip(".") for k in skipped})
        logger.info("skipped %d understanding-only tensors (%s)", len(skipped), ", ".join(parts))


def group_indices(keys: Sequence) -> dict:
    """key -> the indices holding it, in order (rows or requests that share a shape share a call)."""
    groups: dict = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return groups
