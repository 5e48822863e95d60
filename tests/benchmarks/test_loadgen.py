"""The benchmarks' own checks: request accounting, workloads, the scenario table, rendering, perf_analyzer
parsing, repository rewriting, and the load generator and runner against real tritonservers (tiny model).

No timing is asserted anywhere: these tests check that the numbers are computed and
rendered, not what they are.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import loadgen, perf_analyzer, report, run, scenarios, systems, workloads
from benchmarks.loadgen import RequestRecord, RunResult
from tests.helpers.servers import client_threads
from tests.helpers.waiting import wait_until

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
    mixed = workloads.generate(60, (128,), (4, 8, 16), seed=3)
    assert mixed == workloads.generate(60, (128,), (4, 8, 16), seed=3) != workloads.generate(60, (128,), (4, 8, 16))
    assert {s.steps for s in mixed} == {4, 8, 16} and {s.height for s in mixed} == {128}
    sizes = workloads.generate(40, (64, 128), (8,), seed=7, loras=("", "toy_a"), num_frames=9)
    assert {(s.height, s.width, s.steps, s.num_frames) for s in sizes} == {(64, 64, 8, 9), (128, 128, 8, 9)}
    assert [s.lora_name for s in sizes[:4]] == ["", "toy_a", "", "toy_a"]
    assert [s.shape_key for s in workloads.distinct_shapes(sizes)] in (["64x64/8/9f", "128x128/8/9f"],
                                                                         ["128x128/8/9f", "64x64/8/9f"])
    from benchmarks.loadgen import infer_inputs

    assert "lora_name" not in {i.name() for i in infer_inputs(sizes[0], streaming=True)}
    assert "lora_name" in {i.name() for i in infer_inputs(sizes[1], streaming=True)}


# -- the scenario table -------------------------------------------------------------------------


def test_every_scenario_has_a_runner_and_tables_and_valid_engine_parameters():
    from engine_lib.config import EngineConfig
    from engine_lib.pipelines.registry import names

    for sc in scenarios.SCENARIOS.values():
        assert sc.kind in run.RUNNERS and sc.kind in report.TABLES, sc.name
        assert len({s.name for s in sc.systems}) == len(sc.systems), sc.name
        for system in sc.systems:
            assert system.pipeline in names(), (sc.name, system.pipeline)
            if system.repository == systems.MODEL_REPOSITORY:  # the engine's own parser accepts them
                EngineConfig.from_parameters({"pipeline": system.pipeline, **system.parameters})
    with pytest.raises(Exception, match="scheduling_polcy"):
        EngineConfig.from_parameters({"scheduling_polcy": "deadline"})
    assert set(scenarios.QUICK) <= set(scenarios.SCENARIOS)


def test_select_runs_all_or_the_named_ones_and_quick_shrinks_them():
    assert [sc.name for sc in scenarios.select()] == list(scenarios.SCENARIOS)
    assert [sc.name for sc in scenarios.select(["lora", "modes"])] == ["lora", "modes"]
    quick = scenarios.select(quick=True)
    assert [sc.name for sc in quick] == list(scenarios.QUICK)
    for sc in quick:
        full = scenarios.SCENARIOS[sc.name]
        assert (sc.repeats, sc.requests, sc.per_client) <= (full.repeats, full.requests, full.per_client) != (
            sc.repeats, sc.requests, sc.per_client), sc.name
    with pytest.raises(SystemExit, match="unknown scenario"):
        scenarios.select(["nope"])
    gpu = scenarios.on_device(scenarios.SCENARIOS["modes"], "cuda", "bfloat16", "gpu")
    assert gpu.preset == "gpu" and {s.parameters["device"] for s in gpu.systems} == {"cuda"}
    assert [s.parameters.get("dtype") for s in gpu.systems] == ["bfloat16"] * 4 + [None]  # the baseline has none
    assert scenarios.on_device(scenarios.SCENARIOS["lora"], "cuda", "bfloat16", "gpu").preset == "tiny"


# -- systems ----------------------------------------------------------------------------------


def test_prepared_repository_carries_the_system_parameters_and_model_path(tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    for system, model in ((scenarios.M["step"], "qwen_image"), (scenarios.M["naive"], "qwen_image_naive")):
        repo = systems.prepare_repository(system, Path("/models/x"), tmp_path / model)
        config = text_format.Parse((repo / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        params = {k: v.string_value for k, v in config.parameters.items()}
        assert params["model_path"] == "/models/x" and params["device"] == "cpu"
        assert (repo / model / "1" / "model.py").is_file()
        assert config.model_transaction_policy.decoupled == system.streaming
    assert params.get("step_execution") is None
    step = systems.prepare_repository(scenarios.M["step"], Path("/m"), tmp_path / "again") / "qwen_image"
    assert 'key: "max_num_seqs"\n  value {\n    string_value: "8"' in (step / "config.pbtxt").read_text()


def test_batch_stats_reads_engine_histograms_and_tritons_batcher_counters():
    text = ('diffusion_batch_size_sum{model="qwen_image"} 24\ndiffusion_batch_size_count{model="qwen_image"} 4\n'
            'diffusion_batch_size_bucket{model="qwen_image",le="8"} 4\n'
            'diffusion_tick_seconds_sum{model="qwen_image"} 2.5\n'
            'diffusion_batch_retries_total{model="qwen_image"} 1\n'
            'diffusion_cache_steps_total{model="qwen_image",outcome="reused"} 5\n'
            'diffusion_cache_steps_total{model="qwen_image",outcome="computed"} 7\n')
    stats = systems.batch_stats({}, systems.parse_metrics(text))
    assert stats == {"mean_batch_size": 6.0, "ticks": 4.0, "device_busy_s": 2.5, "batch_retries": 1.0,
                     "cache_steps_computed": 7.0, "cache_steps_reused": 5.0}
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


def cells(text: str) -> list[list[str]]:
    """A markdown table's rows as stripped cells (header and rule included)."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines() if "|" in line]


def _point(rps: float, batch: float = 1.0, **extra) -> dict:
    return {"requests_per_s": rps, "latency_p50_s": 1 / rps, "latency_p99_s": 2 / rps, "first_preview_p50_s": None,
            "errors": 0, "server": {"mean_batch_size": batch, "ticks": 48 / batch}, **extra}


def _result(sc: scenarios.Scenario, **data) -> dict:
    from dataclasses import asdict

    return {"scenario": asdict(sc), "command": "python -m benchmarks.run", "started": "then", "wall_s": 60,
            "machine": {"cpus": 2, "cpu_model": "cpu", "ram_gib": 8, "gpu": None, "torch": "2", "diffusers": "0",
                        "load_average": [0.1, 0.1, 0.1]}, **data}


def test_closed_tables_give_medians_spreads_ratios_per_pipeline_and_the_offline_limit(tmp_path):
    sc = scenarios.replace(scenarios.SCENARIOS["modes"], systems=(scenarios.M["serial"], scenarios.M["step"]),
                           concurrency=(1, 8))
    rows = [{"system": name, "label": scenarios.M[name].label, "variant": "", "concurrency": c,
             "points": [_point(rate * f, batch) for f in (0.9, 1.0, 1.2)]}
            for name, batch, rates in (("serial", 1.0, {1: 1.0, 8: 1.0}), ("step", 6.0, {1: 1.0, 8: 3.0}))
            for c, rate in rates.items()]
    offline = {"1": {"pipe": {"images_per_s": 1.0}, "runner": {"images_per_s": 1.1}, "best_images_per_s": 1.1},
               "8": {"pipe": {"images_per_s": 2.0}, "runner": {"images_per_s": 4.0}, "best_images_per_s": 4.0}}
    result = _result(sc, rows=rows, offline=offline)
    table = cells(report.render(result))
    assert table[0][:3] == ["system", "req/s c=1", "req/s c=8"] and table[0][-1] == "/ offline limit (batch 8)"
    assert table[2][:3] == ["REQUEST_BATCH serial", "1.000 (0.900-1.200)", "1.000 (0.900-1.200)"]
    assert table[3][0] == "STEP_BATCH continuous x8" and table[3][2] == "3.000 (2.700-3.600)"
    # p99, first output, requests per forward, forwards, errors, req/s and forwards over serial's, the offline limit
    assert table[3][-8:] == ["0.67", "-", "6.00", "8", "0", "3.00x", "0.17x", "0.75x"]
    assert ["8", "2.000", "4.000"] in table
    assert "`python -m benchmarks.run`, started then, 1.0 min" in report.render(result)
    assert report.plot(result, tmp_path / "modes.png").read_bytes()[:4] == b"\x89PNG"
    two = scenarios.replace(sc, systems=scenarios.serial_vs_step("bagel", 4) + scenarios.serial_vs_step("sd3", 4),
                            concurrency=(4,))
    rows = [{"system": s.name, "label": s.label, "variant": "", "concurrency": 4, "points": [_point(rate)]}
            for s, rate in zip(two.systems, (2.0, 4.0, 1.0, 3.0))]
    table = cells(report.render(_result(two, rows=rows, offline=None)))
    assert [row[-2] for row in table[2:]] == ["1.00x", "2.00x", "1.00x", "3.00x"]  # each over its pipeline's serial
    assert report.plot(_result(two, rows=rows), tmp_path / "one.png") is None  # one concurrency: no curve


def test_poisson_tables_keep_each_systems_median_round_and_attainment_by_shape(tmp_path):
    sc = scenarios.SCENARIOS["slo"]

    def round_(slo: float, p99: float) -> dict:
        return {"offered_rate": 1.0, "requests_per_s": 0.9, "slo_attainment": slo, "latency_p50_s": 1.0,
                "latency_p99_s": p99, "first_preview_p50_s": 0.5, "timed_out": 0, "errors": 0, "requests": 4,
                "duration_s": 10.0, "server": {"mean_batch_size": 1.5, "device_busy_s": 5.0},
                "latencies_s": [0.5, 1.0, p99], "slo_by_shape": {"128x128/16": {"requests": 2, "attainment": slo},
                                                                 "128x128/4": {"requests": 2, "attainment": 1.0}}}
    rows = [{"system": "step", "label": "STEP", "points": [round_(0.5, 9.0), round_(0.75, 4.0), round_(1.0, 2.0)]}]
    result = _result(sc, rows=rows)
    table = cells(report.render(result))
    assert table[2][:6] == ["STEP", "1.000", "0.900", "75 % (50-100)", "1.00", "4.00"]  # the median round's p99
    assert table[3][1:] == ["128x128/4", "128x128/16"] and table[5][1:] == ["100% (2)", "75% (2)"]
    assert report.plot(result, tmp_path / "slo.png").is_file()


def test_priority_perf_analyzer_and_failed_scenarios_render():
    rows = [{"label": "alone", "latencies_s": [0.1] * 10, "background_done": 0},
            {"label": "under load", "latencies_s": [0.2] * 10, "background_done": 42}]
    table = cells(report.render(_result(scenarios.SCENARIOS["priority"], rows=rows)))
    assert table[3] == ["under load", "200", "200", "2.00x", "42"]
    pa = {"perf_analyzer_command": "perf_analyzer -m qwen_image", "summary": perf_analyzer.parse_stdout(PA_STDOUT),
          "export": {"e2e_mean_s": 2.0, "first_response_mean_s": 0.5, "responses_per_request": 3.0},
          "avg_latency_matches": "last response", "comparison": {"loadgen_mean_s": 1.9, "relative_difference": 0.05}}
    table = cells(report.render(_result(scenarios.SCENARIOS["perf-analyzer"], **pa)))
    assert "`perf_analyzer -m qwen_image`: Detected decoupled model" in report.render(_result(
        scenarios.SCENARIOS["perf-analyzer"], **pa))
    assert ["perf_analyzer 'Avg latency'", "2.088"] in table and ["0.857", "3.0", "last response", "0.05"] in table
    failed = report.render(_result(scenarios.SCENARIOS["lora"], error="RuntimeError: no server"))
    assert "Failed: `RuntimeError: no server`" in failed and "|" not in failed

def test_cache_tables_count_the_blocks_saved_against_the_ideal_speed_up():
    def arm(rps, busy, computed=0, reused=0):
        return _point(rps, server={"device_busy_s": busy, "cache_steps_computed": computed,
                                   "cache_steps_reused": reused})

    rounds = [{"order": ["off", "first_block"], "off": arm(1.0, 10.0), "first_block": arm(1.5, 5.0, 12, 12),
               "psnr_db": [30.0, 40.0]},
              {"order": ["first_block", "off"], "off": arm(1.0, 10.0), "first_block": arm(1.3, 6.0, 12, 12),
               "psnr_db": [float("inf"), 20.0]}]
    table = cells(report.render(_result(scenarios.SCENARIOS["step-cache"], blocks=6, rounds=rounds)))
    assert table[2] == ["cache off", "1.000", "1.00", "10.00", "0 / 0", "-", "-", "0"]
    assert table[3][1:] == ["1.400 (1.300-1.500)", "0.72", "5.50", "24 / 24", "0.42", "inf / 20.0", "0"]
    assert table[-1] == ["1.40x (1.30-1.50)", "1.83x (1.67-2.00)", "1.71x", "82 %", "yes"]  # 0.5 x 5/6 saved
    image = np.zeros((1, 4, 4, 3), np.uint8)
    assert report.psnr(image, image) == float("inf") and round(report.psnr(image + 1, image), 2) == 48.13


class _CachingServer:
    """A stand-in for a served model (target and metrics): a cached request reuses one of its steps and its image
    is one level off its uncached one."""

    def __init__(self):
        self.metrics = dict.fromkeys(["diffusion_batch_size_count", "diffusion_batch_size_sum",
                                      "diffusion_cache_steps_total{computed}", "diffusion_cache_steps_total{reused}"],
                                     0.0)
        self.sent = []

    def open(self):
        return self

    def close(self):
        pass

    def run(self, record):
        spec, self.sent = record.spec, self.sent + [record.spec]
        self.metrics["diffusion_batch_size_count"] += spec.steps
        self.metrics["diffusion_batch_size_sum"] += spec.steps
        if spec.cache:
            self.metrics["diffusion_cache_steps_total{computed}"] += spec.steps - 1
            self.metrics["diffusion_cache_steps_total{reused}"] += 1
        record.image = np.full((1, spec.height, spec.width, 3), spec.seed % 200 + bool(spec.cache), np.uint8)
        record.image_shape, record.num_final_flags, record.num_final_outputs = record.image.shape, 1, 1
        record.sent = record.scheduled
        record.done = record.scheduled + 0.01
        return record


def test_the_cache_runner_sends_both_arms_the_same_requests_interleaved_and_compares_their_images(
        tmp_path, monkeypatch):
    import contextlib
    from types import SimpleNamespace

    fake = _CachingServer()
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text('{"num_layers": 6}')
    running = SimpleNamespace(system=scenarios.M["step"], server=SimpleNamespace(metrics_url=""), target=fake)
    monkeypatch.setattr(run, "serving", lambda sc, log_dir: contextlib.nullcontext({"step": running}))
    monkeypatch.setattr(run, "model_path", lambda sc, pipeline: tmp_path)
    monkeypatch.setattr(systems, "scrape_metrics", lambda url: dict(fake.metrics))
    sc = scenarios.replace(scenarios.SCENARIOS["step-cache"], sizes=(8,), steps=(4,), concurrency=(2,), per_client=2)
    result = run.run_cache(sc, tmp_path)
    assert result["blocks"] == 6 and [r["order"] for r in result["rounds"]] == [
        ["off", "first_block"], ["first_block", "off"], ["off", "first_block"]]
    one = result["rounds"][0]
    assert [s.seed for s in fake.sent[:4]] == [s.seed for s in fake.sent[4:8]]  # the same requests in both arms
    assert {(s.cache, s.cache_threshold) for s in fake.sent[4:8]} == {("first_block", 0.8)}
    assert one["first_block"]["server"]["cache_steps_reused"] == 4 and one["off"]["server"]["cache_steps_reused"] == 0
    assert [round(v, 2) for v in one["psnr_db"]] == [48.13] * 4  # one level off everywhere
    assert "first_block, threshold 0.8" in report.render(_result(sc, **result))
    assert [loadgen.spec_values(s)[-2:] for s in fake.sent[4:5]] == [
        [("cache", "BYTES", "first_block"), ("cache_threshold", "FP32", 0.8)]]


class _EditServer:
    """A stand-in for one served edit model: its image is the request's input image (decoded back, halved) moved by
    `shift` levels where `shift` says, and each request counts `per_forward` requests per forward."""

    def __init__(self, per_forward: float, shift=lambda spec: 0):
        self.per_forward, self.shift, self.sent = per_forward, shift, []
        self.metrics = {"diffusion_batch_size_count": 0.0, "diffusion_batch_size_sum": 0.0}

    def open(self):
        return self

    def close(self):
        pass

    def run(self, record):
        from PIL import Image

        values, self.sent = dict((n, v) for n, _, v in loadgen.spec_values(record.spec)), self.sent + [record.spec]
        self.metrics["diffusion_batch_size_count"] += 1
        self.metrics["diffusion_batch_size_sum"] += self.per_forward
        pixels = np.asarray(Image.open(io.BytesIO(values["image"])), np.int16) // 2 + 64 + self.shift(record.spec)
        record.image = pixels.astype(np.uint8)[None]
        record.image_shape, record.num_final_flags, record.num_final_outputs = record.image.shape, 1, 1
        record.sent, record.done = record.scheduled, record.scheduled + 0.01
        return record


def test_the_edits_scenario_sends_each_request_its_own_image_and_compares_it_with_the_serial_one(
        tmp_path, monkeypatch):
    """Every request carries its own image and prompt, both systems get the same ones, and each step-batched image is
    compared with the same request's serial image: the largest difference and the images over one level."""
    import contextlib
    from types import SimpleNamespace

    sc = scenarios.replace(scenarios.select(["edits"], quick=True)[0], per_client=1, min_requests=8,
                           repeats=1)
    serial, step = sc.systems
    fakes = {serial.name: _EditServer(1.0), step.name: _EditServer(4.0, lambda s: {0: 1, 3: -1, 5: 3}.get(s.seed % 100, 0))}
    running = {name: SimpleNamespace(system=system, server=SimpleNamespace(metrics_url=name), target=fakes[name])
               for name, system in zip(fakes, sc.systems)}
    monkeypatch.setattr(run, "serving", lambda sc, log_dir: contextlib.nullcontext(running))
    monkeypatch.setattr(systems, "scrape_metrics", lambda url: dict(fakes[url].metrics))
    result = run.run_closed(sc, tmp_path)
    sent = sorted(fakes[step.name].sent, key=lambda s: s.seed)  # eight clients: in any order
    assert sent == sorted(fakes[serial.name].sent, key=lambda s: s.seed) and len(sent) == 8
    assert len({s.prompt for s in sent}) == len({s.image_seed for s in sent}) == 8
    assert {(s.strength, s.height) for s in sent} == {(sc.edit_strength, 64)}
    values = [dict((n, v) for n, _, v in loadgen.spec_values(s)) for s in sent]
    assert len({v["image"] for v in values}) == 8 and {v["strength"] for v in values} == {sc.edit_strength}
    step_row = next(r for r in result["rows"] if r["system"] == step.name)
    assert step_row["points"][0]["image_diff"] == {"compared": 8, "max_level": 3, "over_one_level": 1, "missing": 0}
    assert "image_diff" not in result["rows"][0]["points"][0]  # the serial system is the reference
    tables = cells(report.render(_result(sc, **result)))
    assert tables[0][-6:] == ["requests per forward c=8", "forwards c=8", "rows per forward c=8 (2 a request)",
                              "errors", "req/s / first row", "forwards / first row"]
    assert tables[2][-6:-3] == ["1.00", "8", "2.00"] and tables[3][-6:-3] == ["4.00", "8", "8.00"]
    ratio = step_row["points"][0]["requests_per_s"] / result["rows"][0]["points"][0]["requests_per_s"]
    assert tables[-1] == [step.label, "8", f"{ratio:.2f}x", "8", "3", "1", "0"]


# -- against real servers (tiny model, 2 requests each) -----------------------------------------


@pytest.fixture(scope="module")
def tiny_model():
    from engine_lib.pipelines.tiny_models import ensure_model

    return ensure_model("qwen_image", "tiny")


def _system_named(name: str) -> systems.System:
    return scenarios.M[name]


def test_loadgen_streams_two_requests_through_step_batching(tiny_model, tmp_path):
    """Two streams at once through step batching; closed, they leave no gRPC thread behind (a cancelled
    tritonclient stream's request iterator otherwise waits for the life of the process)."""
    threads = client_threads()
    with systems.serve(_system_named("step"), tiny_model, log_dir=tmp_path) as running:
        before = systems.scrape_metrics(running.server.metrics_url)
        run = loadgen.run_closed_loop(running.target, [SPEC, SPEC], concurrency=2)
        after = systems.scrape_metrics(running.server.metrics_url)
        left = wait_until(lambda: client_threads() <= threads, 10)
    assert left, f"closed streams left {len(client_threads() - threads)} gRPC thread(s) behind"
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




def test_the_runner_writes_results_tables_and_a_plot_and_records_a_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_LOG_DIR", str(tmp_path / "logs"))
    step = scenarios.System("step", "STEP x2", parameters=systems.engine(step_execution="true", max_num_seqs=2))
    bad = scenarios.System("bad", "bad", parameters=systems.engine(max_num_seqs="many"))
    tiny = dict(preset="tiny", sizes=(64,), steps=(2,), per_client=1, repeats=1)
    monkeypatch.setitem(scenarios.SCENARIOS, "t-closed", scenarios.Scenario(
        "t-closed", "closed", "closed", (step,), concurrency=(1, 2), **tiny))
    monkeypatch.setitem(scenarios.SCENARIOS, "t-bad", scenarios.Scenario("t-bad", "bad", "closed", (bad,), **tiny))
    monkeypatch.setitem(scenarios.SCENARIOS, "t-priority", scenarios.Scenario(
        "t-priority", "priority", "priority", (step,), requests=2, background=1, **tiny))
    assert run.main(["--scenario", "t-closed,t-bad,t-priority", "--out", str(tmp_path)]) == 1
    result = json.loads((tmp_path / "t-closed.json").read_text())
    assert [(r["concurrency"], r["points"][0]["completed"]) for r in result["rows"]] == [(1, 2), (2, 2)]
    assert result["command"].endswith("--scenario t-closed,t-bad,t-priority --out " + str(tmp_path))
    assert "| STEP x2 " in (tmp_path / "t-closed.md").read_text() and (tmp_path / "t-closed.png").is_file()
    assert "max_num_seqs" in json.loads((tmp_path / "t-bad.json").read_text())["error"]
    priority = json.loads((tmp_path / "t-priority.json").read_text())
    assert "error" not in priority, priority["error"]
    assert [(len(r["latencies_s"]), r["background_done"] > 0) for r in priority["rows"]] == [
        (2, False), (2, True), (2, True)]  # alone, under load at priority 1, under load at the background's
