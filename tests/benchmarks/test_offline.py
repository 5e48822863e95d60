"""The offline limit and phase profile run on the tiny model (a smoke test: numbers are for benchmarks only)."""

from __future__ import annotations

from benchmarks import offline


def test_offline_limit_and_profile_run_through_the_engines_runner(tiny_qwen_dir):
    result = offline.run_offline(tiny_qwen_dir, size=64, steps=2, batch=2, repeats=1)
    for batch in ("1", "2"):
        row = result["limit"][batch]
        assert set(row) == {"pipe", "runner", "best_images_per_s"}
        assert row["runner"]["images_per_s"] > 0 and row["pipe"]["images_per_s"] > 0
    profile = result["profile"]
    assert profile["batch_2"]["denoise_step_s"] > 0 and profile["step_speedup_per_request"] > 0
    assert sorted(profile["step_s_by_rows"]) == [1, 2] and min(profile["step_s_by_rows"].values()) > 0


def test_the_gpu_sync_count_runs_every_tick_kind_on_the_cpu():
    """benchmarks/gpu_sync.py (run by gpu.sh) on the CPU, where there are no waits to count: the script and its
    tick classification work before a GPU session spends time on them."""
    from benchmarks import gpu_sync
    from engine_lib.pipelines.registry import get_adapter_class
    from tests.pipelines.parity_checks import load_tiny_adapter

    adapter = load_tiny_adapter("hunyuan_image3", get_adapter_class("hunyuan_image3"))
    summary = gpu_sync.count_waits(adapter, gpu_sync.OTHERS["hunyuan_image3"], steps=2, cuda=False)
    assert set(summary) == {"admitting", "denoising only", "finishing"}
    assert sum(kind["ticks"] for kind in summary.values()) >= 12 and summary["finishing"]["ticks"] > 0
