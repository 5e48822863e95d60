"""engine_lib/host_copy.py: outputs converted on the device are the bytes `interface` conversion gives, and a
tick's tensors come back as C-contiguous numpy arrays (CUDA: through pinned memory, when a GPU is present)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_lib import host_copy
from engine_lib.interface import OutputSpec, to_uint8


def edge_images() -> torch.Tensor:
    """Float images with values below 0, above 1 and exactly on the rounding ties k + 0.5 (x 1/255)."""
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(2, 16, 16, 3, generator=generator) * 1.2 - 0.1
    images.view(-1)[:256] = (torch.arange(256, dtype=torch.float32) + 0.5) / 255
    return images


def test_to_uint8_on_a_tensor_gives_the_bytes_of_interface_to_uint8():
    images = edge_images()
    np.testing.assert_array_equal(host_copy.to_uint8(images).numpy(), to_uint8(images.numpy()))
    permuted = images.permute(0, 3, 1, 2).permute(0, 2, 3, 1)  # a strided view, as post_decode hands it
    np.testing.assert_array_equal(host_copy.to_uint8(permuted).numpy(), to_uint8(images.numpy()))


@pytest.mark.parametrize("datatype", ["UINT8", "FP32", "INT32"])
def test_convert_matches_the_declared_conversion(datatype):
    spec = OutputSpec("x", datatype, (-1,), "x")
    values = edge_images() * (100 if datatype == "INT32" else 1)
    converted = host_copy.convert(spec, values).numpy()
    expected = spec.convert(values.numpy())
    assert converted.dtype == expected.dtype
    np.testing.assert_array_equal(converted, expected)


def devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", devices())
def test_to_host_returns_contiguous_arrays_in_order(device):
    images = edge_images().to(device)
    tensors = [images.permute(0, 2, 1, 3), host_copy.to_uint8(images), torch.arange(5, device=device)]
    arrays = host_copy.HostCopier().to_host(tensors)
    assert [a.flags["C_CONTIGUOUS"] for a in arrays] == [True] * 3
    for array, tensor in zip(arrays, tensors):
        np.testing.assert_array_equal(array, tensor.cpu().numpy())
    assert host_copy.HostCopier().to_host([]) == []
