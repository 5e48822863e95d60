"""What a release's weights cost, from its published configs: the helpers of each pipeline's `releases.py`
(`python -m engine_lib.pipelines.<name>.releases`, the numbers of docs/deployment.md)."""

from __future__ import annotations


def parameters(make) -> int:
    """Parameters of the module `make()` builds, built on the meta device (no weights, no memory)."""
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in make().parameters())


def print_sizes(name: str, parts: dict[str, int]) -> None:
    """One release's total and per-component parameters and bfloat16 sizes."""
    total = sum(parts.values())
    print(f"{name}: {total / 1e9:.2f} B parameters, {2 * total / 2**30:.1f} GiB in bfloat16")
    for part, count in parts.items():
        print(f"  {part}: {count / 1e9:.3f} B, {2 * count / 2**30:.2f} GiB")
