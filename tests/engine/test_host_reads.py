"""No tick reads from the device once its requests are admitted, checked on the CPU.

On CUDA a denoising tick must not wait for the device, and a finishing tick only
once, for its outputs (engine_lib/host_copy.py). The operations that make it wait
can be seen on the CPU too, with a TorchDispatchMode: a tensor's value read on the host (`item()`,
`int(t)`, `bool(t)`, `torch.equal`), shapes that depend on values (`nonzero`,
boolean indexing), and tensors made from host data (`torch.tensor(list)`, on CUDA
a copy from pageable memory that waits). Admission ticks may do these (diffusers'
`encode_prompt` does); every later tick of a steady batch, the finishing one
included, must do none, and so must a tick after some requests finished (a new
membership, without an admission): with previews, true CFG, mixed sizes and mixed
LoRAs; LTX-2, BAGEL and HunyuanImage-3 too. (Helios' diffusers scheduler still reads:
docs/architecture.md.)
"""

from __future__ import annotations

import os
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine_lib.engine import DiffusionEngine
from tests.helpers.parity_checks import TEST_CONFIG, load_tiny_adapter, parse

HOST_READS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "nonzero_numpy", "argwhere", "masked_select",
              "bincount", "lift_fresh", "lift_fresh_copy", "_unique2", "unique_consecutive", "unique_dim"}


ALLOWED = {
    # engine_lib.host_copy.to_device: on CUDA staged in pinned memory and copied without a wait.
    "host_copy.py:to_device",
    # Inside diffusers' own forward, not avoidable without patching diffusers: QwenImageTransformer2DModel,
    # whenever a text mask is passed (prompts of different lengths share a forward), makes
    # torch.as_tensor(text_seq_len, device=...) for a per-row length it then discards.
    "transformer_qwenimage.py:compute_text_seq_len_from_mask",
}


class HostReads(TorchDispatchMode):
    """Counts the operations that would make the host wait for a CUDA device, by op and by the first
    frame outside torch that made it (file:function)."""

    def __init__(self):
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        indices = args[1] if name.startswith("index") and len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
        value_sized = name == "repeat_interleave" and isinstance(args[1] if len(args) > 1 else None, torch.Tensor)
        if name in HOST_READS or value_sized or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                                    for i in indices):
            frame = sys._getframe(1)
            while frame is not None and f"{os.sep}torch{os.sep}" in frame.f_code.co_filename:
                frame = frame.f_back
            where = f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}" if frame else "?"
            if where not in ALLOWED:
                self.seen[f"{func} in {where}"] += 1
        return func(*args, **(kwargs or {}))


def reads_per_tick(adapter, inputs: list[dict]) -> list[Counter]:
    """Admit every request at tick 0 (one wave) and call the engine's `step()` until all have finished (requests
    of 4 and 6 steps alternate: the batch shrinks after tick 3, a new membership without an admission)."""
    engine = DiffusionEngine.wave(adapter, TEST_CONFIG, len(inputs))
    # as the engine's warm-up does before serving: one request alone makes the first-use checks
    # (FlowMatchAdapter.step_batch compares its first batched step with the per-request one)
    engine.generate({"warm-up": parse(adapter, inputs[0])})
    for i, p in enumerate(inputs):
        engine.add_request(f"r{i}", parse(adapter, {**p, "num_inference_steps": 4 + 2 * (i % 2)}))
    ticks = []
    while engine.scheduler.has_requests:
        with HostReads() as reads:
            _, result = engine.step()
        assert not result.errors, result.errors
        ticks.append(reads.seen)
    return ticks


def request(i: int, **kw) -> dict:
    return {"prompt": f"prompt {i}", "seed": i, "height": 32, "width": 32,
            "max_sequence_length": 32, **kw}


def assert_quiet_after_admission(ticks: list[Counter]) -> None:
    assert len(ticks) == 6, ticks
    assert sum(ticks[0].values()) > 0  # the probe sees admission's own reads (prompt encode, first-use checks)
    for index, reads in enumerate(ticks[1:], start=1):
        assert not reads, f"tick {index} would wait for the device: {dict(reads)}"


@pytest.fixture(scope="module", params=["qwen_image", "flux", "sd3"])
def adapter(request):
    from engine_lib.pipelines.registry import get_adapter_class

    return load_tiny_adapter(request.param, get_adapter_class(request.param))


def test_a_steady_batch_reads_nothing_from_the_device(adapter):
    """Previews every 2 steps and (Flux) per-row embedded guidance included."""
    assert_quiet_after_admission(reads_per_tick(adapter, [request(i, preview_interval=2) for i in range(3)]))


def test_true_cfg_reads_nothing_from_the_device(adapter):
    cfg = {"negative_prompt": "blurry"}
    cfg.update({"guidance_scale": 5.0} if adapter.cfg_kind == "cfg" else {"true_cfg_scale": 4.0})
    assert_quiet_after_admission(reads_per_tick(adapter, [request(i, **cfg) for i in range(2)]))


def test_mixed_sizes_read_nothing_from_the_device(adapter):
    if not adapter.step_key_skips:
        pytest.skip(f"{adapter.name} keeps one image size per forward")
    mixed = type(adapter)(adapter.pipe, adapter.device, adapter.dtype, adapter.config.replace(mixed_size_batching=True))
    inputs = [request(i, height=h, width=w) for i, (h, w) in enumerate([(32, 32), (64, 64), (32, 64)])]
    assert_quiet_after_admission(reads_per_tick(mixed, inputs))


def test_mixed_loras_read_nothing_from_the_device(adapter, tmp_path):
    """Rows with different LoRAs (and none) in one forward: each LoRA's rows are an index tensor,
    made once per plan instead of in every layer."""
    from engine_lib.config import EngineConfig
    from engine_lib.pipelines.registry import load_adapter
    from engine_lib.pipelines.tiny_models import ensure_loras, ensure_model

    model_dir = ensure_model(adapter.name, "tiny")
    for name in ("toy_a", "toy_b"):
        shutil.copy(ensure_loras(adapter.name, model_dir) / f"{name}.safetensors", tmp_path)
    with_loras = load_adapter(EngineConfig.of(pipeline=adapter.name, model_path=str(model_dir), device="cpu",
                                              dtype="float32", lora_dir=str(tmp_path)))  # its own pipe
    # 4, 6, 4 and 6 steps: two LoRAs on part of the rows before and after the batch shrinks
    loras = [{"lora_name": "toy_a"}, {"lora_name": "toy_b", "lora_scale": 0.5}, {}, {"lora_name": "toy_a"}]
    assert_quiet_after_admission(reads_per_tick(with_loras, [request(i, **lora) for i, lora in enumerate(loras)]))


def png() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (40, 24), (200, 30, 60)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("pipeline, size, extra", [("ltx2", 32, {"num_frames": 17}), ("bagel", 32, {}),
                                                   ("hunyuan_image3", 64, {})], ids=["ltx2", "bagel", "hunyuan_image3"])
def test_other_pipelines_read_nothing_from_the_device(pipeline, size, extra):
    """LTX-2's three forwards per tick (CFG, spatio-temporal guidance, modality isolation) take each
    request's text rows by slices, and while its first request (an image) runs, each token's timestep is
    made on the device from that request's conditioning mask; BAGEL's query rows and HunyuanImage-3's image
    rows, rebuilt when the batch changes, have their indices and positions made on the host; HunyuanImage-3's
    MoE routes by a grouped matmul, not by `nonzero` per expert. The last request runs without CFG."""
    from engine_lib.pipelines.registry import get_adapter_class

    adapter = load_tiny_adapter(pipeline, get_adapter_class(pipeline))
    no_cfg = {"guidance_scale": 1.0} if pipeline == "hunyuan_image3" else {}
    image = {"image": png()} if pipeline == "ltx2" else {}
    inputs = [{"prompt": f"prompt {i}", "seed": i, "height": size, "width": size, **extra, **(no_cfg if i == 2 else {}),
               **(image if i == 0 else {})} for i in range(3)]
    assert_quiet_after_admission(reads_per_tick(adapter, inputs))
