"""`make bench-packing` runs (one round) and its section renders what it measured."""

from __future__ import annotations

import json

from benchmarks import packing, report


def test_one_round_times_every_pipeline_and_workload_three_ways_and_renders(tmp_path):
    results = packing.run(repeats=1)
    points = {(p["pipeline"], p["workload"]): p for p in results["points"]}
    assert set(points) == {(pipeline, workload) for pipeline in ("qwen_image", "flux", "sd3")
                           for workload in ("two sizes", "eight sizes")}
    for point in points.values():
        ms = point["median_ms"]
        assert set(ms) == {"packed", "per_size", "padded"} and all(value > 0 for value in ms.values())
        assert point["per_size_over_packed"] == ms["per_size"] / ms["packed"]
    (tmp_path / "packing.json").write_text(json.dumps(results))
    text = "\n".join(report.packing_section(tmp_path / "packing.json"))
    sd3 = points["sd3", "eight sizes"]["median_ms"]
    assert f"| sd3 | eight sizes | {sd3['packed']:.1f} |" in text and "1 thread" in text and "(cuda)" not in text
    assert "two sizes: 8x8, 16x16 (128x128 to 256x256 px)" in text
    two = [p["per_size_over_packed"] for p in results["points"] if p["workload"] == "two sizes"]
    assert f"two sizes {min(two):.2f}-{max(two):.2f}x" in text
    assert report.packing_section(tmp_path / "absent.json") == []
    on_gpu = {**results, "workload": {**results["workload"], "device": "cuda", "dtype": "bfloat16", "threads": None,
                                      "sizes": {"two sizes": [[32, 32], [64, 64]]}}}
    (tmp_path / "packing-gpu.json").write_text(json.dumps(on_gpu))
    text = "\n".join(report.packing_section(tmp_path / "packing-gpu.json"))
    assert "packed vs per size vs padded (cuda)" in text and "`cuda` in bfloat16" in text
    assert "two sizes: 32x32, 64x64 (512x512 to 1024x1024 px)" in text
