"""gpu.sh's levers table cannot be measured here (no GPU): the release-size model it builds is Qwen-Image's
release (counted on the meta device), and its entry runs end to end on the CPU with a tiny model."""

from __future__ import annotations

import json
import re

import torch

from benchmarks import levers
from engine_lib.pipelines.qwen_image import tiny


def test_the_release_preset_builds_qwen_image_s_release_transformer_and_vae():
    with torch.device("meta"):
        parts = tiny.components(levers.release_preset(), seed=0)
    billions = sum(p.numel() for p in parts["transformer"].parameters()) / 1e9
    assert 20.4 < billions < 20.5, billions  # Qwen/Qwen-Image's transformer: 20.43 B
    assert parts["transformer"].config.joint_attention_dim == parts["text_encoder"].config.text_config.hidden_size
    vae = parts["vae"].config
    assert (vae.base_dim, vae.z_dim, list(vae.dim_mult)) == (96, 16, [1, 2, 4, 4])


def test_the_gpu_levers_entry_runs_every_arm_on_the_cpu_with_a_tiny_model(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPILE_BACKEND", "eager")  # inductor's C++ build takes minutes here
    out = tmp_path / "out"
    levers.main(["--device", "cpu", "--dtype", "float32", "--preset", "tiny", "--model", str(tmp_path / "model"),
                 "--size", "64", "--steps", "2", "--batch", "1", "--repeats", "1", "--out", str(out)])
    points = {p["arm"]: p for p in json.loads((out / "levers.json").read_text())["levers"]["points"]}
    assert set(points) == {arm + cache for arm in levers.ARMS for cache in levers.CACHES}
    refused = {arm: p["refused"] for arm, p in points.items() if "refused" in p}
    assert not refused, refused  # on the CPU: fp8 as weight-only, compile on dynamo's eager backend
    assert points["eager"]["max_levels"] == 0 and points["compile"]["max_levels"] <= 2
    assert points["int8"]["transformer_bytes"] < points["eager"]["transformer_bytes"]
    assert points["fp8"]["max_levels"] > 0 and points["fp8"]["psnr_db"] < 100  # against eager float32, not itself
    assert re.search(r"^\| eager +\| [\d.]+ +\| 1.00x", (out / "levers.md").read_text(), re.M)
