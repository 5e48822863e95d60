"""`make bench-packing` runs (one round) and its section renders what it measured."""

from __future__ import annotations

import json

from benchmarks import packing, report


def test_one_round_times_every_pipeline_three_ways_and_renders(tmp_path):
    results = packing.run(repeats=1)
    assert set(results["pipelines"]) == {"qwen_image", "flux", "sd3"}
    for entry in results["pipelines"].values():
        ms = entry["median_ms"]
        assert set(ms) == {"packed", "per_size", "padded"} and all(value > 0 for value in ms.values())
        assert entry["per_size_over_packed"] == ms["per_size"] / ms["packed"]
    (tmp_path / "packing.json").write_text(json.dumps(results))
    text = "\n".join(report.packing_section(tmp_path / "packing.json"))
    sd3 = results["pipelines"]["sd3"]
    assert f"| sd3 | {sd3['median_ms']['packed']:.1f} |" in text and "4 rows of 8x8 patch tokens" in text
    assert "(128x128 and 256x256 images)" in text and "1 thread" in text and "(cuda)" not in text
    assert report.packing_section(tmp_path / "absent.json") == []
    on_gpu = {**results, "workload": {**results["workload"], "device": "cuda", "dtype": "bfloat16", "threads": None,
                                      "small_tokens": [32, 32], "large_tokens": [64, 64]}}
    (tmp_path / "packing-gpu.json").write_text(json.dumps(on_gpu))
    text = "\n".join(report.packing_section(tmp_path / "packing-gpu.json"))
    assert "packed vs per size vs padded (cuda)" in text and "`cuda` in bfloat16" in text and "512x512 and 1024x1024" in text
