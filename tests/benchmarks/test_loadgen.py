"""The benchmark's own checks: request accounting, report rendering, perf_analyzer parsing,
repository rewriting, and the load generator against real tritonservers (tiny model, 2 requests).

No timing is asserted anywhere: these tests check that the numbers are computed and
rendered, not what they are.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import loadgen, perf_analyzer, report, systems, workloads
from benchmarks.loadgen import RequestRecord, RunResult

SPEC = workloads.RequestSpec("a cat", 64, 64, 4, seed=1, preview_interval=2)


def _done(rid: str, scheduled: float, latency: float, spec=SPEC, **changes) -> RequestRecord:
    record = RequestRecord(rid, spec, scheduled=scheduled, sent=scheduled, first_response=scheduled + latency / 2,
                           done=scheduled + latency, num_responses=2, num_final_flags=1, num_final_outputs=1,
                           image_shape=(1, spec.height, spec.width, 3))
    for key, value in changes.items():
        setattr(record, key, value)
    return record


# -- request accounting -----------------------------------------------------------------------


@pytest.mark.parametrize("changes, reason", [
    ({"num_final_flags": 2}, "2 FINAL flags"),
    ({"num_final_flags": 0}, "0 FINAL flags"),
    ({"num_final_outputs": 2}, "2 responses with is_final=true"),
    ({"late_responses": 1}, "1 responses after FINAL"),
    ({"image_shape": (1, 32, 64, 3)}, "image shape"),
    ({"error": "INVALID_ARG: input 'height'"}, "INVALID_ARG"),
])
def test_a_request_that_breaks_the_contract_is_an_error_not_a_completion(changes, reason):
    bad = _done("bad", 0.0, 1.0, **changes)
    assert not bad.ok and reason in bad.check_error()
    summary = loadgen.summarize(RunResult("closed", [_done("good", 0.0, 1.0), bad], concurrency=2))
    assert summary["completed"] == 1 and summary["errors"] == 1
    assert summary["latencies_s"] == [1.0]


def test_summary_counts_throughput_percentiles_and_slo_from_the_records():
    records = [_done(f"r{i}", 0.0, 1.0 + i) for i in range(4)]  # latencies 1, 2, 3, 4 s; last done at 4 s
    summary = loadgen.summarize(RunResult("closed", records, concurrency=4), {SPEC.shape_key: 1.0}, slo_factor=2.5)
    assert summary["requests_per_s"] == pytest.approx(1.0)
    assert summary["latency_p50_s"] == pytest.approx(2.5)
    assert summary["latency_mean_s"] == pytest.approx(2.5)
    assert summary["slo_attainment"] == pytest.approx(0.5)  # 1 s and 2 s are within 2.5 x 1 s


def test_poisson_arrivals_are_seeded_increasing_and_at_the_rate():
    a = loadgen.poisson_arrivals(2000, rate=4.0, seed=3)
    assert a == loadgen.poisson_arrivals(2000, rate=4.0, seed=3)
    assert all(x < y for x, y in zip(a, a[1:]))
    assert len(a) / a[-1] == pytest.approx(4.0, rel=0.1)


def test_workloads_are_deterministic_and_cover_their_choices():
    mixed = workloads.mixed_steps(60, 128, (4, 8, 16), seed=3)
    assert mixed == workloads.mixed_steps(60, 128, (4, 8, 16), seed=3)
    assert {s.steps for s in mixed} == {4, 8, 16}
    sizes = workloads.mixed_sizes(40, (64, 128), 8, seed=7)
    assert {(s.height, s.steps) for s in sizes} == {(64, 8), (128, 8)}
    assert [s.shape_key for s in workloads.distinct_shapes(sizes)] in (["64x64/8", "128x128/8"],
                                                                         ["128x128/8", "64x64/8"])


# -- systems ----------------------------------------------------------------------------------


def test_prepared_repository_carries_the_system_parameters_and_model_path(tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    step = next(s for s in systems.default_systems(max_num_seqs=8) if s.name == "step")
    repo = systems.prepare_repository(step, Path("/models/x"), tmp_path)
    config = text_format.Parse((repo / "qwen_image" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["step_execution"] == "true" and params["max_num_seqs"] == "8"
    assert params["model_path"] == "/models/x" and params["pipeline"] == "qwen_image"
    assert config.model_transaction_policy.decoupled
    assert (repo / "qwen_image" / "1" / "model.py").is_file()


def test_batch_stats_reads_engine_histograms_and_tritons_batcher_counters():
    text = ('diffusion_batch_size_sum{model="qwen_image"} 24\ndiffusion_batch_size_count{model="qwen_image"} 4\n'
            'diffusion_batch_size_bucket{model="qwen_image",le="8"} 4\n'
            'diffusion_tick_seconds_sum{model="qwen_image"} 2.5\n'
            'diffusion_batch_retries_total{model="qwen_image"} 1\n')
    stats = systems.batch_stats({}, systems.parse_metrics(text))
    assert stats == {"mean_batch_size": 6.0, "ticks": 4.0, "device_busy_s": 2.5, "batch_retries": 1.0}
    triton = systems.parse_metrics('nv_inference_count{model="m",version="1"} 12\n'
                                   'nv_inference_exec_count{model="m",version="1"} 3\n')
    assert systems.batch_stats({}, triton)["mean_batch_size"] == 4.0


# -- perf_analyzer ----------------------------------------------------------------------------

PA_STDOUT = """\
  Detected decoupled model, using the first response for measuring latency

Request concurrency: 2
  Client:
    Request count: 6
    Throughput: 0.856872 infer/sec
    Response Throughput: 3.42749 infer/sec
    Avg latency: 2088178 usec (standard deviation 1648326 usec)
    p50 latency: 1472287 usec
    p99 latency: 4359632 usec
"""


def test_perf_analyzer_output_and_export_are_parsed_and_attributed():
    summary = perf_analyzer.parse_stdout(PA_STDOUT)
    assert summary["throughput_per_s"] == pytest.approx(0.856872)
    assert summary["response_throughput_per_s"] == pytest.approx(3.42749)
    assert summary["avg_latency_s"] == pytest.approx(2.088178)
    assert summary["decoupled_note"].startswith("Detected decoupled model")
    export = {"experiments": [{"requests": [
        {"timestamp": 0, "response_timestamps": [1_000_000_000, 2_088_178_000]},
        {"timestamp": 10, "response_timestamps": [900_000_010, 2_088_178_010]},
    ]}]}
    parsed = perf_analyzer.parse_export(export)
    assert parsed["e2e_mean_s"] == pytest.approx(2.088178)
    assert parsed["first_response_mean_s"] == pytest.approx(0.95)
    assert parsed["responses_per_request"] == 2
    result = {"summary": summary, "export": parsed}
    assert perf_analyzer.which_latency(result) == "last response"
    assert perf_analyzer.compare(result, 2.0)["within_margin"] is True
    assert perf_analyzer.compare(result, 1.0)["within_margin"] is False
    data = perf_analyzer.input_data(SPEC)["data"][0]
    assert data["prompt"]["content"] == ["a cat"] and data["num_inference_steps"]["content"] == [4]


# -- report -----------------------------------------------------------------------------------


def _closed(rps: float, batch: float = 1.0) -> dict:
    return {"requests_per_s": rps, "images_per_s": rps, "latency_mean_s": 1 / rps, "latency_p50_s": 1 / rps,
            "latency_p95_s": 1.2 / rps, "latency_p99_s": 1.3 / rps, "first_preview_p50_s": None,
            "slo_attainment": 1.0, "errors": 0, "duration_s": 10.0,
            "server": {"mean_batch_size": batch, "device_busy_s": 9.0}}


def _system(label: str, rps1: float, rps8: float, poisson_p99: float = None, slo: float = None) -> dict:
    out = {"label": label, "closed": {"1": [_closed(rps1)], "8": [_closed(rps8 * 0.9, 6.0), _closed(rps8, 6.0),
                                                                   _closed(rps8 * 1.1, 6.0)]},
           "peak_rss_bytes": 500 * 2**20, "startup_s": 20.0}
    if poisson_p99 is not None:
        out["poisson"] = {"offered_rate": 0.3, "requests_per_s": 0.3, "latency_mean_s": 1.0, "latency_p50_s": 1.0,
                          "latency_p95_s": poisson_p99, "latency_p99_s": poisson_p99, "slo_attainment": slo,
                          "errors": 0, "latencies_s": [0.5, 1.0, poisson_p99], "server": {"mean_batch_size": 2.0}}
    return out


def canned_results() -> dict:
    from benchmarks.run import QUICK

    from dataclasses import asdict

    layer = {"encode_s_per_request": 0.01, "denoise_step_s": 0.2, "denoise_step_s_per_request": 0.2,
             "scheduler_step_s_per_request": 0.001, "decode_s_per_request": 0.05, "request_s_per_request": 1.0,
             "top_ops": [{"op": "aten::addmm", "share": 0.6}]}
    batched = dict(layer, denoise_step_s=1.0, denoise_step_s_per_request=0.125, request_s_per_request=0.6)
    return {
        "plan": dict(asdict(QUICK), concurrencies=[1, 8]),
        "machine": {"nproc": 2, "cpu_model": "test CPU", "ram_gib": 8, "python": "3.11", "torch": "2", "diffusers": "0",
                    "gpu": None},
        "load_before": [0.5, 0.5, 0.5], "load_after": [1.0, 1.0, 1.0], "started": "now", "wall_s": 120,
        "solo_latency_s": {"128x128/4": 1.0}, "poisson_rate": 0.3,
        "systems": {
            "rb_serial": _system("REQUEST_BATCH serial", 1.0, 1.0, poisson_p99=10.0, slo=0.5),
            "step": _system("STEP_BATCH continuous x8", 1.0, 3.0, poisson_p99=4.0, slo=0.9),
            "naive": _system("naive baseline", 0.9, 0.9),
            "rb_fused_wait": {"label": "REQUEST_BATCH fused x8 + 20 ms wait", "mixed_sizes": {"requests_per_s": 2.0}},
        },
        "offline": {"limit": {"1": {"pipe": {"images_per_s": 1.0}, "runner": {"images_per_s": 1.1},
                                    "best_images_per_s": 1.1},
                              "8": {"pipe": {"images_per_s": 2.0}, "runner": {"images_per_s": 3.2},
                                    "best_images_per_s": 3.2}},
                    "profile": {"size": 128, "steps": 4, "batch": 8, "batch_1": layer, "batch_8": batched,
                                "step_speedup_per_request": 1.6, "request_speedup_per_request": 1.67,
                                "step_s_by_rows": {"1": 0.2, "2": 0.3, "8": 1.0}}},
    }


def test_targets_compare_medians_and_say_met_or_by_how_much_missed():
    by_name = {t["target"].split(",")[0].split(":")[-1].strip(): t for t in report.targets(canned_results())}
    vs_serial = by_name["STEP_BATCH / REQUEST_BATCH serial"]
    assert vs_serial["value"] == pytest.approx(3.0) and vs_serial["met"]
    assert by_name["STEP_BATCH served images/s at concurrency 8 / offline limit (batch 8)"]["value"] == \
        pytest.approx(3.0 / 3.2)
    p99 = by_name["STEP_BATCH p99 / REQUEST_BATCH serial p99"]
    assert p99["value"] == pytest.approx(0.4) and p99["met"]
    slo = by_name["STEP_BATCH SLO attainment (3x solo latency)"]
    assert slo["met"] is False and report.fmt_met(slo) == "missed (95% of the goal)"


def test_the_mixed_sizes_target_compares_each_step_system_with_fused_waves():
    results = canned_results()
    results["systems"]["step"]["mixed_sizes"] = {"requests_per_s": 2.4}
    results["systems"]["step_mixed"] = {"label": "STEP_BATCH x8, mixed_size_batching", "closed": {},
                                        "mixed_sizes": {"requests_per_s": 3.0}}
    sizes = [t for t in report.targets(results) if t["target"].startswith("Mixed sizes")]
    assert [(round(t["value"], 3), t["met"]) for t in sizes] == [(1.2, False), (1.5, True)]
    assert "STEP_BATCH x8, mixed_size_batching / REQUEST_BATCH fused x8 + 20 ms wait" in sizes[1]["target"]


def test_repeated_side_loads_compare_round_by_round_and_keep_the_median_round():
    from benchmarks.run import median_point

    results = canned_results()
    S = results["systems"]
    step_rounds = [dict(S["step"]["poisson"], latency_p99_s=p99, slo_attainment=slo)
                   for p99, slo in ((4.0, 0.9), (6.0, 0.7), (3.0, 0.95))]
    serial_rounds = [dict(S["rb_serial"]["poisson"], latency_p99_s=p99) for p99 in (10.0, 10.0, 5.0)]
    S["step"].update(poisson_points=step_rounds, poisson=median_point(step_rounds, "slo_attainment"))
    S["rb_serial"].update(poisson_points=serial_rounds, poisson=median_point(serial_rounds, "slo_attainment"))
    assert S["step"]["poisson"] is step_rounds[0]  # the median attainment's round, whole
    S["step"]["mixed_sizes_points"] = [{"requests_per_s": r} for r in (2.4, 3.0, 2.0)]
    S["step"]["mixed_sizes"] = median_point(S["step"]["mixed_sizes_points"], "requests_per_s")
    S["rb_fused_wait"]["mixed_sizes_points"] = [{"requests_per_s": r} for r in (2.0, 2.0, 2.5)]
    by_name = {t["target"].split(",")[0].split(":")[-1].strip(): t for t in report.targets(results)}
    p99 = by_name["STEP_BATCH p99 / REQUEST_BATCH serial p99"]  # rounds 0.4, 0.6, 0.6
    assert p99["value"] == pytest.approx(0.6) and p99["span"] == pytest.approx((0.4, 0.6)) and not p99["met"]
    slo = by_name["STEP_BATCH SLO attainment (3x solo latency)"]
    assert slo["value"] == pytest.approx(0.9) and report.fmt_target_value(slo) == "90% (70%-95%)"
    [sizes] = [t for t in report.targets(results) if t["target"].startswith("Mixed sizes")]  # 1.2, 1.5, 0.8
    assert sizes["value"] == pytest.approx(1.2) and sizes["span"] == pytest.approx((0.8, 1.5))
    text = "\n".join(report.poisson_section(results, "img/"))
    assert "| 90% (70%-95%) |" in text and "median round" in text and "slo_model" not in text
    results["poisson_model"] = {"requests": 40, "on_time": [36, None, 35]}
    text = "\n".join(report.poisson_section(results, "img/"))
    assert "finishes more than 36, fewer than 36, 35 of its 40 requests" in text and "is 38 of these 40" in text
    results["machine"]["gpu"] = "a GPU"  # the model's costs are the CPU's
    assert "slo_model" not in "\n".join(report.poisson_section(results, "img/"))
    results["machine"]["gpu"] = None
    assert report.retries_note(S) == []
    step_rounds[1]["server"] = {"mean_batch_size": 2.0, "batch_retries": 2}
    assert report.retries_note(S) == ["- Batches that failed and ran again one request at a time (see the servers' "
                                      "logs): `step` 2."]
    assert "| 2.400 (2.000-3.000) |" in "\n".join(report.mixed_sizes_section(results))


def test_report_writes_markdown_and_two_pngs_from_a_results_file(tmp_path):
    source = tmp_path / "quick.json"
    source.write_text(json.dumps(canned_results()))
    doc, throughput, cdf = report.write_report(source, tmp_path / "docs" / "bench.md")
    for png in (throughput, cdf):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = doc.read_text()
    assert "## Targets" in text and "## GPU" in text and "not measured yet" in text.lower()
    assert "| REQUEST_BATCH serial | 1.000 | 1.000 (0.900-1.100) |" in text  # median and spread over repeats
    assert "What limits the missed targets" in text and "1.60x cheaper per request" in text
    assert "One denoise step of n rows costs, in steps of one row: 2: 1.50x, 8: 5.00x" in text
    assert "(img/bench-throughput.png)" in text


def _tiny_point(rps: float, p50: float) -> dict:
    return {"requests_per_s": rps, "latency_p50_s": p50, "latency_p99_s": 2 * p50, "errors": 0}


def test_other_pipelines_table_gives_step_over_serial_and_old_results_render_without_it(tmp_path):
    old = canned_results()
    assert report.other_pipelines_section(old) == []
    assert "Other pipelines" not in report.render(old, tmp_path / "old.json")
    new = dict(old, other_pipelines={"flux": {"preset": "tiny", "systems": {
        "flux_serial": {"label": "flux REQUEST_BATCH serial", "closed": {"1": _tiny_point(2.0, 0.5),
                                                                         "8": _tiny_point(2.0, 4.0)}},
        "flux_step": {"label": "flux STEP_BATCH continuous x8", "closed": {"1": _tiny_point(2.0, 0.5),
                                                                           "8": _tiny_point(5.0, 1.5)}}}}})
    text = "\n".join(report.other_pipelines_section(new))
    assert "## Other pipelines (tiny presets)" in text and "not model speed" in text
    assert "| flux | flux STEP_BATCH continuous x8 | 2.000 | 0.500 s | 1.000 s | 5.000 | 1.500 s | 3.000 s | 2.50x | 0 |" \
        in text
    assert "| flux | flux REQUEST_BATCH serial | 2.000 | 0.500 s | 1.000 s | 2.000 | 4.000 s | 8.000 s | - | 0 |" in text


def test_tiny_pipeline_systems_are_serial_and_continuous_on_the_pipelines_own_repository(tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    serial, step = systems.tiny_pipeline_systems("sd3", max_num_seqs=8)
    assert (serial.parameters["step_execution"], serial.parameters["max_num_seqs"]) == ("false", "1")
    assert (step.parameters["step_execution"], step.parameters["max_num_seqs"]) == ("true", "8")
    repo = systems.prepare_repository(step, Path("/models/sd3"), tmp_path)
    config = text_format.Parse((repo / "sd3" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["pipeline"] == "sd3" and params["max_sequence_length"] == "32"


# -- against real servers (tiny model, 2 requests each) -----------------------------------------


@pytest.fixture(scope="module")
def tiny_model():
    from engine_lib.tiny_models import ensure_model

    return ensure_model("qwen_image", "tiny")


def _system_named(name: str) -> systems.System:
    return next(s for s in systems.default_systems(max_num_seqs=4) if s.name == name)


def test_loadgen_streams_two_requests_through_step_batching(tiny_model, tmp_path):
    with systems.serve(_system_named("step"), tiny_model, log_dir=tmp_path) as running:
        before = systems.scrape_metrics(running.server.metrics_url)
        run = loadgen.run_closed_loop(running.target, [SPEC, SPEC], concurrency=2)
        after = systems.scrape_metrics(running.server.metrics_url)
    for record in run.records:
        assert record.ok, record.check_error()
        assert record.num_final_flags == 1 and record.num_final_outputs == 1
        assert record.first_preview is not None and record.first_preview <= record.done  # step 2 of 4
    summary = loadgen.summarize(run)
    assert summary["completed"] == 2 and summary["errors"] == 0 and summary["requests_per_s"] > 0
    assert systems.batch_stats(before, after)["ticks"] >= 4  # 4 denoise steps at least


def test_loadgen_drives_the_naive_baseline_and_flags_a_wrong_shape(tiny_model, tmp_path):
    with systems.serve(_system_named("naive"), tiny_model, log_dir=tmp_path) as running:
        good = loadgen.run_closed_loop(running.target, [SPEC, SPEC], concurrency=2)
        bad = loadgen.run_closed_loop(running.target, [workloads.RequestSpec("x", 64, 64, 2, seed=0, num_images=2)], 1)
    assert [r.ok for r in good.records] == [True, True], [r.check_error() for r in good.records]
    assert good.records[0].image_shape == (1, 64, 64, 3)
    assert "image shape" in bad.records[0].check_error()  # the baseline makes 1 image where 2 were asked for


def test_lora_workload_sends_the_lora_input_and_its_section_renders(tmp_path):
    import json

    from benchmarks import report
    from benchmarks.loadgen import infer_inputs

    specs = workloads.mixed_loras(6, 64, 4, ("", "toy_a", "toy_b"), seed=1)
    assert [s.lora_name for s in specs] == ["", "toy_a", "toy_b"] * 2
    assert "lora_name" not in {i.name() for i in infer_inputs(specs[0], streaming=True)}
    assert "lora_name" in {i.name() for i in infer_inputs(specs[1], streaming=True)}
    point = {"requests_per_s": 2.0, "server": {"mean_batch_size": 3.0}, "errors": 0}
    results = {"started": "t", "workload": {"size": 64, "steps": 4, "loras": ["none", "toy_a"], "concurrency": 8,
                                            "requests_per_point": 16, "repeats": 1},
               "systems": {"lora_mixed": {"label": "mixed", "points": [point]},
                           "lora_homogeneous": {"label": "homogeneous", "points": [{**point, "requests_per_s": 1.0}]}},
               "mixed_over_homogeneous": 2.0, "mixed_over_homogeneous_fifo": 3.0}
    (tmp_path / "lora.json").write_text(json.dumps(results))
    text = "\n".join(report.lora_section(tmp_path / "lora.json"))
    assert "| mixed | 2.000" in text and "| homogeneous | 1.000" in text and "2.00x" in text and "3.00x" in text
    assert report.lora_section(tmp_path / "absent.json") == []
