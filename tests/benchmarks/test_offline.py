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
