"""The offline limit, the phase profile and the packed forwards run on the tiny models, and their tables render
(smoke tests: the numbers are the benchmarks' business)."""

from __future__ import annotations

from benchmarks import offline, packing, report


def test_offline_limit_and_profile_run_through_the_engines_runner(tiny_qwen_dir):
    adapter = offline.load_adapter(tiny_qwen_dir, "cpu", "float32")
    limit = offline.OfflineLimit(adapter, 64, 2, [2, 1])
    limit.warm()
    limit.sample()
    summary = limit.summary()
    assert sorted(summary) == ["1", "2"]
    for row in summary.values():
        assert row["runner"]["images_per_s"] > 0 and row["pipe"]["images_per_s"] > 0
        assert row["best_images_per_s"] == max(row["pipe"]["images_per_s"], row["runner"]["images_per_s"])
    profile = offline.phase_profile(adapter, 64, 2, 2, repeats=1)
    assert profile["batch_2"]["denoise_step_s"] > 0 and sorted(profile["step_s_by_rows"]) == [1, 2]
    text = "\n".join(report.profile_tables({"profile": profile}))
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()]
    first = {row[0]: row for row in rows}
    assert "whole request (2 steps)" in first and first["1"][2] == "1.00x" and first["2"][1] != "-"


def test_one_round_times_every_pipeline_and_workload_three_ways_and_renders(monkeypatch):
    # Each workload cut to its first and last rows (two sizes each): the same code paths, a quarter of the work.
    monkeypatch.setattr(packing, "WORKLOADS", {name: [sizes[0], sizes[-1]] for name, sizes in packing.WORKLOADS.items()})
    # The flex way as the plain packed call: eager flex costs this CPU seconds a forward (its parity is
    # test_qwen_image's and test_flux's packed forward tests); here its place in the run and the table.
    monkeypatch.setattr(packing, "_on_flex", lambda transformer, call: call())
    results = packing.run(repeats=1)
    points = {(p["pipeline"], p["workload"]): p for p in results["points"]}
    assert set(points) == {(pipeline, workload) for pipeline in ("qwen_image", "flux", "sd3")
                           for workload in ("two sizes", "eight sizes")}
    for point in points.values():
        ms = point["median_ms"]
        assert set(ms) - {"packed_flex"} == {"packed", "per_size", "padded"} and all(value > 0 for value in ms.values())
        assert point["per_size_over_packed"] == ms["per_size"] / ms["packed"]
    assert {pipeline for pipeline, _ in points if "packed_flex" in points[pipeline, "two sizes"]["median_ms"]} == {
        "qwen_image", "flux"}  # SD3's processor takes no backend
    sd3 = points["sd3", "eight sizes"]["median_ms"]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in report.packing_tables(results)[0].splitlines()]
    assert ["sd3", "eight sizes", f"{sd3['packed']:.1f}"] in [row[:3] for row in rows]
