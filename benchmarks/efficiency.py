"""`make bench-efficiency`: the served engine against the offline batched limit, with the per-phase profile.

For the tiny Qwen-Image at 64x64 and the bench preset at 128x128 (8 steps, batch /
concurrency 8, the workload's six prompts cycling), side by side in rounds:

* offline: diffusers `pipe(prompt=[8 prompts])` in a fresh process (main thread), called
  back to back for as many images as the engine's point serves: images over the total time;
* runner: the engine's own loop (`ModelRunner.run_to_completion`) over 8 requests admitted
  together, in a fresh process the same way: the engine's per-tick code without its threads
  and without a closed loop's arrivals (requests joining and finishing at different ticks);
* in-process engine: `DiffusionEngine` (step mode, `max_num_seqs=8`) in a fresh
  process, fed by 8 closed-loop client threads; its phase clock splits the engine
  thread's time (engine_lib/phases.py);
* served: tritonserver with the same engine, 8 closed-loop gRPC clients; the split
  comes from `diffusion_engine_phase_seconds_total` (engine thread and sender).

Why fresh processes: with libgomp, torch work on two threads of one process makes
OpenMP count more threads than cores and stop spinning between parallel regions
(measured: the tiny model's engine thread ran 1.5x slower after a pipe() call on the
main thread). Results: benchmarks/results/efficiency.json; docs/benchmarks.md.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

from benchmarks import loadgen, systems, workloads
from benchmarks.run import machine_info, side_main

# (preset, image size, requests per point). A closed loop starts and ends with partly empty
# batches, which the offline limit never has: each point must run long enough (about 2.5 s on
# tiny, 10 s on bench here) that they are a small part of it. With 48 tiny requests (0.3 s) the
# engine's first 70 ms formed its two cohorts of 4, a fifth of the point (measured, per-tick trace).
PRESETS = (("tiny", 64, 384), ("bench", 128, 48))
STEPS, BATCH = 8, 8


def _worker(kind: str, preset: str, size: int, requests: int) -> dict:
    """One measurement in this (fresh) process: images or requests per second, and the engine's phases."""
    import torch

    from benchmarks.offline import load_adapter, request_params
    from engine_lib.request import DiffusionRequest
    from engine_lib.runner import ModelRunner
    from engine_lib.tiny_models import ensure_model

    prompts = [workloads.PROMPTS[i % len(workloads.PROMPTS)] for i in range(requests)]
    if kind in ("offline", "runner"):
        adapter = load_adapter(ensure_model("qwen_image", preset), device="cpu", dtype="float32")
        def call():
            if kind == "offline":
                adapter.pipe(prompt=prompts[:BATCH], height=size, width=size, num_inference_steps=STEPS,
                             generator=[torch.Generator().manual_seed(i) for i in range(BATCH)], output_type="np")
                return
            batch = [DiffusionRequest(f"r{i}", request_params(adapter, prompts[i], size, STEPS, i)) for i in range(BATCH)]
            assert not ModelRunner(adapter).run_to_completion(batch).output.errors
        call()
        times = []
        for _ in range(max(1, requests // BATCH)):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        # Sustained, as the engine's closed loop is measured (its requests over its whole run), so a slow
        # call counts in both; the median call (the statistic before) is kept beside it.
        return {"per_s": BATCH * len(times) / sum(times), "per_s_median_call": BATCH / statistics.median(times)}
    from engine_lib.config import EngineConfig
    from engine_lib.engine import DiffusionEngine

    config = EngineConfig(pipeline="qwen_image", model_path=str(ensure_model("qwen_image", preset)),
                          step_execution=True, max_num_seqs=BATCH, device="cpu", dtype="float32", warmup=True,
                          max_queue=4 * requests)
    engine = DiffusionEngine.make_engine(config)  # loads the pipeline as tritonserver's model does
    try:
        def run(n: int) -> float:
            ids = iter(range(n))
            lock = threading.Lock()

            def client():
                while True:
                    with lock:
                        i = next(ids, None)
                    if i is None:
                        return
                    out = engine.add_request(f"r{time.monotonic_ns()}-{i}", {
                        "prompt": prompts[i % len(prompts)], "height": size, "width": size,
                        "num_inference_steps": STEPS, "seed": i}).result(timeout=600)
                    assert out.error is None, out.error

            threads = [threading.Thread(target=client) for _ in range(BATCH)]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return n / (time.perf_counter() - start)

        run(BATCH)  # warm: first batch shapes
        before = engine.stats().phase_seconds
        per_s = run(requests)
        after = engine.stats().phase_seconds
        return {"per_s": per_s, "phases": {k: after[k] - before[k] for k in after}}
    finally:
        engine.close()


def _in_fresh_process(kind: str, preset: str, size: int, requests: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.efficiency", "--worker", kind, preset, str(size),
                          str(requests)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def offline_images_per_s(preset: str, size: int, requests: int) -> float:
    """The offline limit at one size: `pipe(prompt=[8 prompts])`, 8 steps, in a fresh process."""
    return _in_fresh_process("offline", preset, size, requests)["per_s"]


def add_lockstep_point(entry: dict, kind: str, preset: str, size: int, requests: int) -> None:
    """An offline or runner point: sustained images/s, and the median call's beside it."""
    point = _in_fresh_process(kind, preset, size, requests)
    entry[kind].append(point["per_s"])
    entry[f"{kind}_median_call"].append(point["per_s_median_call"])


_PHASE = re.compile(r'^diffusion_engine_phase_seconds_total\{([^}]*)\}\s+(\S+)', re.M)


def served_phases(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=5) as reply:
        text = reply.read().decode()
    phases: dict[str, float] = {}
    for labels, value in _PHASE.findall(text):
        phase = re.search(r'phase="([^"]+)"', labels).group(1)
        phases[phase] = phases.get(phase, 0.0) + float(value)
    return phases


def run(repeats: int = 3, log_dir: Optional[Path] = None) -> dict:
    from engine_lib.tiny_models import ensure_model

    results = {"kind": "efficiency", "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(),
               "workload": {"steps": STEPS, "batch": BATCH, "repeats": repeats},
               "presets": {}}
    for preset, size, requests in PRESETS:
        model_path = ensure_model("qwen_image", preset)
        system = systems.System(f"efficiency_{preset}", f"STEP_BATCH x{BATCH}", systems.MODEL_REPOSITORY,
                                "qwen_image", parameters=dict(device="cpu", dtype="float32", warmup="true",
                                                              step_execution="true", max_num_seqs=str(BATCH)))
        entry = results["presets"][preset] = {"size": size, "requests": requests, "offline": [], "runner": [],
                                              "offline_median_call": [], "runner_median_call": [],
                                              "engine": [], "served": [],
                                              "engine_phases": [], "served_phases": []}
        with systems.serve(system, model_path, log_dir=log_dir) as rs:
            metrics_url = rs.server.metrics_url
            specs = workloads.uniform(requests, size, STEPS, 0, seed=600)
            loadgen.run_closed_loop(rs.target, specs[:BATCH], BATCH, tag="warm")
            for r in range(repeats):
                add_lockstep_point(entry, "offline", preset, size, requests)
                add_lockstep_point(entry, "runner", preset, size, requests)
                engine = _in_fresh_process("engine", preset, size, requests)
                entry["engine"].append(engine["per_s"])
                entry["engine_phases"].append(engine["phases"])
                before = served_phases(metrics_url)
                start = time.perf_counter()
                run_ = loadgen.run_closed_loop(rs.target, specs, BATCH, tag=f"served-{r}")
                entry["served"].append(sum(1 for rec in run_.records if rec.ok) / (time.perf_counter() - start))
                time.sleep(1.0)  # the metrics thread samples every 0.5 s
                after = served_phases(metrics_url)
                entry["served_phases"].append({k: after[k] - before.get(k, 0.0) for k in after})
                print(f"[efficiency] {preset} repeat {r}: offline {entry['offline'][-1]:.2f}/s, runner "
                      f"{entry['runner'][-1]:.2f}/s, engine "
                      f"{entry['engine'][-1]:.2f}/s, served {entry['served'][-1]:.2f}/s", flush=True)
        med = {k: statistics.median(entry[k]) for k in ("offline", "runner", "engine", "served")}
        entry["median"] = med
        entry["served_over_offline"] = med["served"] / med["offline"]
        entry["engine_over_offline"] = med["engine"] / med["offline"]
        entry["runner_over_offline"] = med["runner"] / med["offline"]
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        kind, preset, size, requests = argv[1], argv[2], int(argv[3]), int(argv[4])
        print(json.dumps(_worker(kind, preset, size, requests)))
        return 0
    return side_main(__doc__, "efficiency", run, lambda r: "served / offline: " + ", ".join(
        f"{p} {e['served_over_offline']:.2f}x (engine {e['engine_over_offline']:.2f}x)"
        for p, e in r["presets"].items()), argv)


if __name__ == "__main__":
    raise SystemExit(main())
