"""The in-process systems (benchmarks/in_process.py) and the scheduling benchmark built on them
(benchmarks/scheduling.py), on the tiny Qwen-Image: requests are accounted as the gRPC sessions account
them, and the benchmark runs every stage without Triton's packages (the lent GPU machine has none).

No timing is asserted: these check what is counted, not what it measures.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import loadgen, report, systems, workloads
from benchmarks.in_process import InProcessSystem
from benchmarks.loadgen import RequestRecord

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def step_system(tiny_qwen_dir) -> InProcessSystem:
    step = next(s for s in systems.default_systems(max_num_seqs=4) if s.name == "step")
    return InProcessSystem(step, tiny_qwen_dir)


def _record(spec, deadline=None) -> RequestRecord:
    record = RequestRecord(f"r{time.monotonic_ns()}", spec, scheduled=time.perf_counter())
    record.deadline = deadline
    return record


def test_a_request_is_accounted_as_over_grpc_progress_previews_and_one_final_image(step_system):
    spec = workloads.RequestSpec("a cat", 64, 48, 4, seed=1, preview_interval=2)
    with step_system.running() as running:
        session = running.target.open()
        record = session.run(_record(spec))
        stats = running.tally.stats()
    assert record.ok, record.check_error()
    assert record.image_shape == (1, 64, 48, 3)
    assert record.first_preview is not None and record.num_responses >= 2  # previews at steps 2 (and 4: final)
    assert stats["ticks"] == 4 and stats["mean_batch_size"] == 1.0 and stats["batch_retries"] == 0  # not warm-up


def test_a_bad_request_and_a_passed_deadline_end_as_that_requests_errors(step_system):
    with step_system.running() as running:
        session = running.target.open()
        bad = session.run(_record(workloads.RequestSpec("a cat", 65, 64, 4, seed=1)))
        late = session.run(_record(workloads.RequestSpec("a cat", 64, 64, 4, seed=1), deadline=time.perf_counter()))
        good = session.run(_record(workloads.RequestSpec("a cat", 64, 64, 2, seed=1)))
    assert bad.check_error().startswith("send failed: input 'height'")
    assert "timed out" in late.check_error()
    summary = loadgen.summarize(loadgen.RunResult("closed", [bad, late, good]))
    assert (summary["completed"], summary["errors"], summary["timed_out"]) == (1, 2, 1)


def test_each_point_gets_a_fresh_engine_over_the_loaded_weights(step_system, tiny_qwen_dir):
    shared: dict = {}
    by_name = {s.name: s for s in systems.default_systems(max_num_seqs=4)}
    serial, step, mixed = (InProcessSystem(by_name[name], tiny_qwen_dir, shared)
                           for name in ("rb_serial", "step", "step_mixed"))
    assert serial.adapter is step.adapter  # engine parameters only: one set of weights
    assert mixed.adapter is not step.adapter and mixed.adapter.mixed_size_batching  # an adapter option
    with step.running() as first:
        pass
    with step.running() as second:
        assert second.target.engine is not first.target.engine
    assert not first.target.engine.stats().thread_alive


# Triton's packages and the other front doors: the lent GPU machine has none of them (KINDS.md).
BLOCKED = ("tritonclient", "pytriton", "fastapi", "uvicorn", "openai", "av", "ftfy")


def test_the_scheduling_benchmark_runs_every_stage_without_tritons_packages(tmp_path, tiny_qwen_dir):
    out = tmp_path / "scheduling-smoke.json"
    block = "; ".join(f"sys.modules[{name!r}] = None" for name in BLOCKED)
    code = (f"import sys; {block}; from benchmarks import scheduling; "
            f"sys.exit(scheduling.main(['--plan', 'smoke', '--no-report', '--out', {str(out)!r}]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    S = results["systems"]
    for name in ("rb_fused_wait", "step", "step_mixed"):
        assert [p["errors"] for p in S[name]["mixed_sizes_points"]] == [0]
    for name in ("rb_serial", "step", "step_srpt", "step_deadline"):
        (point,) = S[name]["poisson_points"]
        assert point["errors"] == 0 and point["completed"] == point["requests"] == 4
        assert set(point["solo_latency_s"]) == {"64x64/2", "64x64/3"}  # the round's own calibration
        assert 0 < report.busy_share(point) <= 1
    assert set(results["urgent"]) == {"alone", "priority_preempt", "priority_separate"}
    assert results["wall_s"] > 0
    rows = report.scheduling_targets(results)
    assert len(rows) == 7 and all(t["value"] is not None for t in rows)
    assert report.scheduling_headline(results) in done.stdout


def test_the_report_shows_an_in_process_run_and_a_run_cut_short(tmp_path):
    results = {"kind": "scheduling", "started": "2026-12-02 12:00:00",
               "plan": {"name": "gpu", "preset": "gpu", "device": "cuda", "dtype": "bfloat16", "mixed_sizes": [64, 128],
                        "mixed_steps": 8, "concurrency": 16, "poisson_requests": 40, "size": 128,
                        "step_choices": [4, 8, 16], "poisson_load": 0.8, "slo_factor": 3.0, "urgent_requests": 30,
                        "urgent_size": 64, "urgent_steps": 8, "urgent_background": 8, "urgent_max_num_seqs": 4,
                        "repeats": 2},
               "machine": {"gpu": "NVIDIA H200", "nproc": 16}, "solo_latency_s": {"128x128/4": 0.1},
               "poisson_rate": 5.0, "systems": {}}

    def point(rps=None, slo=None):
        return {"requests_per_s": rps, "slo_attainment": slo, "latency_p99_s": 0.5, "errors": 0,
                "server": {"mean_batch_size": 4.0}}

    results["systems"] = {
        "rb_fused_wait": {"label": "fused", "mixed_sizes_points": [point(10.0), point(10.0)]},
        "step": {"label": "step", "mixed_sizes_points": [point(15.0), point(12.0)],
                 "poisson_points": [point(slo=0.975), point(slo=0.9)]}}  # cut short: no urgent, no wall_s
    path = tmp_path / "scheduling-gpu.json"
    path.write_text(json.dumps(results))
    text = "\n".join(report.scheduling_section(path, heading="###"))
    assert "### Scheduling targets with the engine in-process (NVIDIA H200)" in text
    assert "| Mixed sizes (64, 128), c=16: step / fused, requests/s | 1.35x (1.20x-1.50x) | >= 1.3x | met |" in text
    assert "| Poisson mixed steps: step SLO attainment | 94% (90%-98%) | >= 95% | missed" in text
    assert "stopped before its end" in text


def test_the_device_scripts_parse_and_carry_the_pinned_wheels():
    """benchmarks/device.sh runs only on the lent GPU machine: here, its shell parses and the wheels it installs
    are the ones scripts/device_wheels.sh downloads, at requirements.txt's pins."""
    device, wheels = REPO / "benchmarks" / "device.sh", REPO / "scripts" / "device_wheels.sh"
    for script in (device, wheels):
        subprocess.run(["bash", "-n", str(script)], check=True)
    pins = (REPO / "requirements.txt").read_text().splitlines()
    for package in ("diffusers", "transformers"):
        assert any(line.startswith(f"{package}==") for line in pins)
        assert f"$(pin {package})" in wheels.read_text() and f".whl/{package}-*.whl" in device.read_text()
    assert "/.whl/" in (REPO / ".gitignore").read_text().splitlines()  # carried, never committed
