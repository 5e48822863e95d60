"""The `think` scenario's runner on the tiny BAGEL: both systems decode the same tokens, the baseline one row per
text forward, and the report puts the counts side by side."""

from __future__ import annotations

from dataclasses import asdict, replace

from benchmarks import report, scenarios, think
from engine_lib.pipelines.tiny_models import ensure_model


def test_one_loop_shares_text_forwards_the_baseline_runs_one_row_each():
    sc = scenarios.SCENARIOS["think"]
    systems = tuple(replace(s, parameters={**s.parameters, "warmup": "false"}) for s in sc.systems)  # (seconds)
    specs = think.requests(4, 64, 2, 8)  # two think (8 tokens at most), two plain, all admitted at once
    result = think.run(systems, lambda r: specs, 4, 1, ensure_model("bagel", "tiny"))
    loop, baseline = (result["rounds"][0]["systems"][s.name] for s in sc.systems)
    assert baseline["text_rows"] == baseline["text_forwards"]  # one request decodes per tick
    assert loop["text_rows"] == baseline["text_rows"]  # the same thoughts, token for token
    assert loop["text_forwards"] < baseline["text_forwards"]  # the two thoughts shared forwards
    assert loop["denoise_rows"] == baseline["denoise_rows"] == 4 * 2 * 2  # 4 images, 2 steps, CFG: 2 rows each
    assert loop["texts_equal"] and baseline["texts_equal"] and baseline["image_max_level"] <= 1
    text = report.render({"scenario": asdict(replace(sc, repeats=1)), "command": "python -m benchmarks.run",
                          "started": "then", "wall_s": 60, "machine": {
                              "cpus": 2, "cpu_model": "x", "ram_gib": 1, "gpu": None, "torch": "t", "diffusers": "d",
                              "load_average": [0, 0, 0]}, **result})
    assert f"| {baseline['text_forwards']} " in text and "| 1.00 " in text
