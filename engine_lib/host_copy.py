"""A tick's outputs from the device to numpy with one host synchronisation: the runner's only way back.

Adapters may hand back torch tensors on their device (images, previews); the runner
converts them to the declared dtypes there (`convert`, UINT8 rounded as
`interface.to_uint8` rounds) and, once per tick, `HostCopier.to_host` copies every
one of them into pinned host memory on a side stream and waits for that stream
once: the one synchronisation that ends the tick. Before, each output's `.cpu()`
waited for the device on its own. On the CPU the tensors become numpy arrays
without a copy. The other way, `to_device` puts small host values (per-row
guidance, row indices) on the device without waiting: a plain
`torch.tensor(values, device="cuda")` copies from pageable memory and waits.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from engine_lib.interface import OutputSpec


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """`interface.to_uint8` on a tensor: the same float32 operations, so the same bytes."""
    return (images.to(torch.float32).clamp(0, 1) * 255).round().to(torch.uint8)


def convert(spec: OutputSpec, tensor: torch.Tensor) -> torch.Tensor:
    """`OutputSpec.convert` on the device."""
    if spec.datatype == "UINT8":
        return tensor if tensor.dtype == torch.uint8 else to_uint8(tensor)
    return tensor.to({"FP32": torch.float32, "INT32": torch.int32}[spec.datatype])


def to_device(values, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` (or a host tensor's `.to(device, dtype)`) without a
    host wait: on CUDA staged in pinned memory and copied asynchronously (the caching host allocator keeps
    the buffer until the copy is done)."""
    host = values.to(dtype or values.dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class HostCopier:
    """Device tensors to numpy: on CUDA through pinned memory on a side stream, with one wait."""

    def __init__(self) -> None:
        self._stream: Optional[torch.cuda.Stream] = None  # made on the device of the first CUDA outputs

    def to_host(self, tensors: list[torch.Tensor]) -> list[np.ndarray]:
        """C-contiguous numpy arrays of `tensors`, in order."""
        on_device = [i for i, t in enumerate(tensors) if t.device.type == "cuda"]
        hosts: list[Any] = [None if t.device.type == "cuda" else t.contiguous() for t in tensors]
        if on_device:
            device = tensors[on_device[0]].device
            stream = self._stream = self._stream or torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # after their kernels
            with torch.cuda.stream(stream):
                for i in on_device:
                    host = torch.empty(tensors[i].shape, dtype=tensors[i].dtype, pin_memory=True)
                    host.copy_(tensors[i], non_blocking=True)
                    tensors[i].record_stream(stream)  # its memory is not reused before the copy is done
                    hosts[i] = host
            stream.synchronize()  # the tick's one host synchronisation for its outputs
        return [h.numpy() for h in hosts]
