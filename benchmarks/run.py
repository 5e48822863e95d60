"""The benchmark runner: `python -m benchmarks.run [--scenario NAME[,NAME]] [--quick]`.

For each scenario of benchmarks/scenarios.py: its systems up and warmed, its workload in rounds (each round every
system once, so a slow drift of the machine hits every system alike), then benchmarks/results/<name>.json and .md
and docs/img/<name>.png (with --quick, all in benchmarks/results/quick/). A scenario that fails is recorded with its
error and the next one runs."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shlex
import statistics
import sys
import threading
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from benchmarks import loadgen, offline, perf_analyzer, report, scenarios, systems, workloads
from benchmarks.scenarios import Scenario

RESULTS_DIR = Path(__file__).resolve().parent / "results"
IMG_DIR = systems.REPO_ROOT / "docs" / "img"
POISSON_SEED, ARRIVAL_SEED = 3, 11  # the Poisson load's requests and arrival times


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def machine_info() -> dict:
    import diffusers
    import torch

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
               platform.processor() or "unknown")
    return {"cpus": os.cpu_count(), "cpu_model": cpu,
            "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3, 1),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__,
            "load_average": [round(load, 2) for load in os.getloadavg()]}


def model_path(sc: Scenario, pipeline: str) -> Path:
    from engine_lib.pipelines.tiny_models import ensure_loras, ensure_model

    path = ensure_model(pipeline, sc.preset)
    if any(lora for _, v in sc.variants for lora in v.get("loras", ())) or any(sc.loras):
        ensure_loras(pipeline, path)
    return path


def specs(sc: Scenario, n: int, seed: int, priority: int = 0, **overrides) -> list:
    """n requests of the scenario's workload (with `overrides` of its fields), at `priority` (0: not sent)."""
    sc = replace(sc, **overrides)
    out = workloads.generate(n, sc.sizes, sc.steps, seed, sc.preview_interval, sc.loras, sc.num_frames, priority)
    return workloads.edits(out, sc.edit_strength) if sc.edit_strength else out


@contextlib.contextmanager
def serving(sc: Scenario, log_dir: Path):
    """Every system of the scenario up and warmed (one request alone, then a full batch), {name: running}."""
    with contextlib.ExitStack() as stack:
        running = {}
        for system in sc.systems:
            start = time.perf_counter()
            running[system.name] = rs = stack.enter_context(systems.serve(system, model_path(sc, system.pipeline),
                                                                          log_dir=log_dir))
            log(f"{system.name}: ready in {time.perf_counter() - start:.1f} s")
            warm = specs(sc, max(sc.concurrency), seed=99)
            loadgen.run_closed_loop(rs.target, warm[:1], 1, tag="warm1")
            loadgen.run_closed_loop(rs.target, warm, max(sc.concurrency), tag="warm")
        yield running


def measure(rs: systems.RunningSystem, run: Callable[[], loadgen.RunResult], solo: Optional[dict] = None,
            slo_factor: float = 3.0) -> tuple[dict, loadgen.RunResult]:
    """A load-generator run's summary plus the server's batch statistics over it (its metrics endpoint); the run."""
    before = systems.scrape_metrics(rs.server.metrics_url)
    result = run()
    summary = loadgen.summarize(result, solo, slo_factor)
    summary["server"] = systems.batch_stats(before, systems.scrape_metrics(rs.server.metrics_url))
    return summary, result


def measure_closed(rs: systems.RunningSystem, workload: list, concurrency: int, tag: str) -> tuple[dict, dict]:
    """`measure` of a closed loop, without its per-request latencies; and its images by request seed."""
    point, run = measure(rs, lambda: loadgen.run_closed_loop(rs.target, workload, concurrency, tag))
    point.pop("latencies_s")
    return point, {rec.spec.seed: rec.image for rec in run.records if rec.ok}


def run_closed(sc: Scenario, log_dir: Path) -> dict:
    """Closed loops (N clients, each sending its next request when its last one ends): each round every variant and
    concurrency on every system back to back, then the offline sample; with `compare_images` each image against the
    same request's on its pipeline's first system."""
    points: dict[tuple, list] = {}  # (system, variant, concurrency) -> its point of each round
    limit = None
    with serving(sc, log_dir) as running:
        if sc.offline:
            adapter = offline.load_adapter(model_path(sc, sc.systems[0].pipeline),
                                           sc.systems[0].parameters["device"], sc.systems[0].parameters["dtype"])
            limit = offline.OfflineLimit(adapter, sc.sizes[0], sc.steps[0], sorted({1, max(sc.concurrency)}))
            limit.warm()
        for r in range(sc.repeats):
            for variant, overrides in sc.variants or (("", {}),):
                for c in sc.concurrency:
                    workload = specs(sc, max(sc.per_client * c, sc.min_requests), 100 + r, **overrides)
                    images: dict[str, dict] = {}
                    for name, rs in running.items():
                        point, images[name] = measure_closed(rs, workload, c, f"{name}{c}r{r}")
                        if sc.compare_images:
                            first = next(s.name for s in sc.systems if s.pipeline == rs.system.pipeline)
                            if first != name:
                                point["image_diff"] = image_diff(images[first], images[name])
                                base = points[first, variant, c][-1]["requests_per_s"]
                                point["throughput_vs_first"] = point["requests_per_s"] / base if (
                                    base and point["requests_per_s"]) else None
                        points.setdefault((name, variant, c), []).append(point)
                        log(f"round {r} {name} {variant} c={c}: {point['requests_per_s'] or 0:.3f} req/s, "
                            f"{point['errors']} errors" + (f", images {point['image_diff']}" if "image_diff" in point
                                                           else ""))
            if limit is not None:
                limit.sample()
    rows = [{"system": name, "label": running[name].system.label, "variant": variant, "concurrency": c,
             "points": pts} for (name, variant, c), pts in points.items()]
    return {"rows": rows, "offline": limit.summary() if limit else None}


def image_diff(reference: dict, images: dict) -> dict:
    """How far each image is from the reference image of the same request (both keyed by the request's seed): the
    largest difference in uint8 levels over every pixel, and how many images differ by more than one level."""
    levels = [int(np.abs(image.astype(np.int16) - reference[seed].astype(np.int16)).max())
              for seed, image in images.items() if seed in reference]
    return {"compared": len(levels), "max_level": max(levels, default=None),
            "over_one_level": sum(level > 1 for level in levels), "missing": len(set(reference) ^ set(images))}


def calibrate_solo(rs: systems.RunningSystem, workload: Sequence, repeats: int = 2) -> dict:
    """Median latency of each distinct request shape alone on the server: shape key -> seconds."""
    solo = {}
    for spec in workloads.distinct_shapes(workload):
        run = loadgen.run_closed_loop(rs.target, [spec] * repeats, 1, tag=f"solo-{spec.shape_key}")
        latencies = [r.latency for r in run.records if r.ok]
        if not latencies:
            raise RuntimeError(f"solo run of {spec.shape_key} failed: {[r.check_error() for r in run.records]}")
        solo[spec.shape_key] = statistics.median(latencies)
    return solo


def run_poisson(sc: Scenario, log_dir: Path) -> dict:
    """Rounds of the same arrival sequence; before each, the first system (serial) calibrates the solo latencies
    (the SLOs) and the rate (`load` x its capacity), since a shared machine's speed drifts over minutes."""
    workload = specs(sc, sc.requests, POISSON_SEED)
    rows: dict[str, dict] = {}
    with serving(sc, log_dir) as running:
        for r in range(sc.repeats):
            solo = calibrate_solo(running[sc.systems[0].name], workload)
            rate = sc.load / statistics.mean(solo[s.shape_key] for s in workload)
            log(f"round {r}: {rate:.3f} requests/s; solo latencies {solo}")
            for name, rs in running.items():
                slo_s = {k: sc.slo_factor * v for k, v in solo.items()} if rs.system.deadlines else None
                point, _ = measure(rs, lambda: loadgen.run_open_loop(rs.target, workload, rate, seed=ARRIVAL_SEED,
                                                                  tag=f"{name}{r}", slo_s=slo_s), solo, sc.slo_factor)
                point["solo_latency_s"] = solo
                rows.setdefault(name, {"system": name, "label": rs.system.label, "points": []})["points"].append(point)
                log(f"round {r} {name}: SLO attainment {point['slo_attainment']:.0%}, {point['errors']} errors")
    return {"rows": list(rows.values())}


def run_priority(sc: Scenario, log_dir: Path) -> dict:
    """Urgent requests one at a time (a 0.2 s pause between), alone and under `background` closed-loop clients
    of priority 3; on each system with priority 1, and on the first with priority 3 (plain arrival order)."""
    urgent = specs(sc, sc.requests, 8)
    rows = []
    with serving(sc, log_dir) as running:
        first = running[sc.systems[0].name]
        arms = [("alone, idle server", first, 1, False)] + [
            (f"under load, {rs.system.label}", rs, 1, True) for rs in running.values()] + [
            ("under load, priority 3 like the background (arrival order)", first, 3, True)]
        for i, (label, rs, priority, loaded) in enumerate(arms):
            with background(rs.target, specs(sc, 1, 7, priority=3)[0], sc.background if loaded else 0, f"bg{i}") as bg:
                run = loadgen.run_closed_loop(rs.target, [replace(s, priority=priority) for s in urgent], 1,
                                              f"fg{i}", pause_s=0.2)
            failed = [r.check_error() for r in run.records if not r.ok]
            if failed:
                raise RuntimeError(f"{label}: {failed[0]}")
            latencies = [r.latency for r in run.records]
            rows.append({"label": label, "latencies_s": latencies, "background_done": sum(r.ok for r in bg)})
            log(f"{label}: p99 {loadgen.percentile(latencies, 99) * 1000:.0f} ms")
    return {"rows": rows}


@contextlib.contextmanager
def background(target, spec, clients: int, tag: str):
    """`clients` closed-loop clients sending `spec` (a new seed each time) until the block ends; the list it
    yields holds their records after it."""
    stop, records = threading.Event(), []
    endless = itertools.takewhile(lambda _: not stop.is_set(), (replace(spec, seed=i) for i in itertools.count()))
    thread = threading.Thread(target=lambda: records.extend(
        loadgen.run_closed_loop(target, endless, clients, tag).records), daemon=True)
    thread.start()
    time.sleep(1.0 if clients else 0)  # the queue fills before the first urgent request
    try:
        yield records
    finally:
        stop.set()
        thread.join(120)


def run_perf_analyzer(sc: Scenario, log_dir: Path) -> dict:
    """perf_analyzer at one concurrency, between two load-generator runs of the same requests."""
    c, spec = sc.concurrency[0], specs(sc, 1, 0)[0]
    with serving(sc, log_dir) as running:
        rs = running[sc.systems[0].name]
        before = loadgen.summarize(loadgen.run_closed_loop(rs.target, [spec] * sc.requests, c, tag="pa-before"))
        result = perf_analyzer.run(rs.target.url, rs.target.model, spec, c, sc.requests)
        means = [before, loadgen.summarize(loadgen.run_closed_loop(rs.target, [spec] * sc.requests, c, tag="pa-after"))]
    result["loadgen_mean_latencies_s"] = means = [m["latency_mean_s"] for m in means if m["latency_mean_s"]]
    result["comparison"] = perf_analyzer.compare(result, statistics.mean(means) if means else None)
    return result


def run_cache(sc: Scenario, log_dir: Path) -> dict:
    """Each round: the same requests (prompts, seeds) with the cache off and at `cache_threshold`, in alternating
    order; the cache's decisions from the metrics, and each image's PSNR against its uncached run."""
    arms = {"off": {}, "first_block": {"cache": "first_block", "cache_threshold": sc.cache_threshold}}
    c, rounds = sc.concurrency[0], []
    with serving(sc, log_dir) as running:
        rs = running[sc.systems[0].name]
        for r in range(sc.repeats):
            workload = specs(sc, max(sc.per_client * c, sc.min_requests), 100 + r)
            points, images = {}, {}
            for arm in list(arms)[::-1 if r % 2 else 1]:
                points[arm], images[arm] = measure_closed(rs, [replace(spec, **arms[arm]) for spec in workload], c,
                                                          f"{arm}{r}")
                log(f"round {r} {arm}: {points[arm]['requests_per_s'] or 0:.3f} req/s, {points[arm]['errors']} errors")
            psnr = [report.psnr(images["off"][seed], image) for seed, image in images["first_block"].items()
                    if seed in images["off"]]
            rounds.append({"order": list(points), **points, "psnr_db": psnr})
    # The transformer's block count (its config.json's num_layers): a reused step runs one of them.
    config = model_path(sc, sc.systems[0].pipeline) / "transformer" / "config.json"
    return {"blocks": int(json.loads(config.read_text())["num_layers"]), "rounds": rounds}


def in_process_device() -> tuple[str, str]:
    """The in-process scenarios run on CUDA in bfloat16 where there is a GPU, else on the CPU in float32."""
    import torch

    return ("cuda", "bfloat16") if torch.cuda.is_available() else ("cpu", "float32")


def run_profile(sc: Scenario, log_dir: Path) -> dict:
    """One Qwen-Image request's phases solo and batched, in-process (offline.phase_profile)."""
    adapter = offline.load_adapter(model_path(sc, "qwen_image"), *in_process_device())
    return {"profile": offline.phase_profile(adapter, sc.sizes[0], sc.steps[0], sc.concurrency[0], sc.repeats)}


def run_packing(sc: Scenario, log_dir: Path) -> dict:
    """One forward over rows of several sizes, packed, per size and padded, in-process (benchmarks/packing.py)."""
    from benchmarks import packing

    device, dtype = in_process_device()
    return packing.run(sc.repeats, device, dtype, scale=4 if device == "cuda" else 1)


def run_think(sc: Scenario, log_dir: Path) -> dict:
    """Think and plain BAGEL requests through each system's engine in-process, the work counted
    (benchmarks/think.py)."""
    from benchmarks import think

    size, steps, c = sc.sizes[0], sc.steps[0], sc.concurrency[0]
    return think.run(sc.systems, lambda r: think.requests(max(sc.per_client * c, sc.min_requests), size, steps,
                                                          sc.max_new_tokens, seed=100 + r),
                     c, sc.repeats, model_path(sc, sc.systems[0].pipeline))


def run_levers(sc: Scenario, log_dir: Path) -> dict:
    """Each GPU lever's time per step, weight bytes and images against eager float32 (benchmarks/levers.py)."""
    from benchmarks import levers

    return levers.run(model_path(sc, "qwen_image"), *in_process_device(), sc.sizes[0], sc.steps[0],
                      sc.concurrency[0], sc.repeats)


RUNNERS = {"closed": run_closed, "poisson": run_poisson, "priority": run_priority,
           "perf_analyzer": run_perf_analyzer, "profile": run_profile, "packing": run_packing, "cache": run_cache,
           "think": run_think, "levers": run_levers}


def run_scenario(sc: Scenario, out_dir: Path, img_dir: Path, command: str, log_dir: Path) -> dict:
    """Run one scenario, then write its JSON, its tables and its plots; a failure is recorded, not raised."""
    log(f"scenario {sc.name}: {sc.title}")
    result = {"scenario": asdict(sc), "command": command, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": machine_info()}
    start = time.perf_counter()
    try:
        result.update(RUNNERS[sc.kind](sc, log_dir))
    except Exception as exc:  # noqa: BLE001 - recorded; the next scenario still runs
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["wall_s"] = time.perf_counter() - start
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{sc.name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out_dir / f"{sc.name}.md").write_text(report.render(result))
    report.plot(result, img_dir / f"{sc.name}.png")
    log(f"scenario {sc.name} done in {result['wall_s']:.0f} s: {out_dir / sc.name}.json, .md")
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="", help=f"comma-separated, of: {', '.join(scenarios.SCENARIOS)}")
    parser.add_argument("--quick", action="store_true", help="make bench-quick's scenarios and sizes")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    parser.add_argument("--preset", default=None, help="model preset instead of `bench` (e.g. gpu)")
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results[/quick])")
    parser.add_argument("--cache-threshold", type=float, default=None,
                        help="the cache scenarios' first_block threshold (another preset reuses at another one)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.scenario.split(",") if n.strip()]
    out_dir = Path(args.out) if args.out else RESULTS_DIR / ("quick" if args.quick else "")
    img_dir = out_dir if (args.quick or args.out) else IMG_DIR
    command = "python -m benchmarks.run " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv))
    log_dir = Path(os.environ.get("BENCH_LOG_DIR", "/tmp/bench-logs"))
    chosen = [sc if args.cache_threshold is None or sc.kind != "cache" else replace(
        sc, cache_threshold=args.cache_threshold) for sc in scenarios.select(names, args.quick)]
    results = [run_scenario(scenarios.on_device(sc, args.device, args.dtype, args.preset), out_dir, img_dir,
                            command, log_dir) for sc in chosen]
    print("\n".join(report.render(r) for r in results))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
