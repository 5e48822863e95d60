"""`make bench` / `make bench-quick`: every system side by side in one run, then the report.

One run (all on the `bench` random-weight Qwen-Image preset):

1. Start one tritonserver per system (each on a temporary copy of its model
   repository) and keep them all up; idle servers cost next to nothing. Warm
   each one up, and load the same pipeline in-process for the offline limit.
2. REQUEST_BATCH serial calibrates the solo latency of every request shape
   (the SLO is 3x that) and the serial capacity (the Poisson rate is a fraction
   of it).
3. Closed-loop sweep, interleaved: for each repeat and concurrency, every
   system runs the same requests back to back, then one offline sample is
   taken, so slow drifts in machine load hit every system alike.
4. Mixed sizes, then open-loop Poisson arrivals of the mixed-steps workload (the
   same arrival sequence each time), in rounds: each round runs every system
   once, one after the other, at a rate recalibrated just before it
   (`poisson_calibration`); the point kept for a system is its median round
   (`median_point`), the others give the spread. Then perf_analyzer against the
   STEP_BATCH server.
5. Servers stop; a per-phase profile runs in-process.
6. Other pipelines (flux, sd3) on their tiny presets: REQUEST_BATCH serial and
   STEP_BATCH continuous, each on its own server, one after the other.

Results go to benchmarks/results/<plan>.json; docs/benchmarks.md and
docs/img/*.png are regenerated from the newest full result (else quick).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

from benchmarks import loadgen, offline, perf_analyzer, report, systems, workloads
from benchmarks.procstats import PeakRssSampler, cpu_split

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Plan:
    """Sizes and counts of one benchmark run."""

    name: str
    preset: str = "bench"
    device: str = "cpu"
    dtype: str = "float32"
    size: int = 128
    steps: int = 8
    concurrencies: tuple = (1, 2, 4, 8, 16)
    rounds: int = 3  # closed loop: each virtual client sends this many requests per point
    repeats: int = 3  # closed-loop repeats per point (medians and spread over them)
    max_num_seqs: int = 8
    wait_ms: float = 20.0
    preview_interval: int = 4
    mixed_step_choices: tuple = (4, 8, 16)
    mixed_sizes: tuple = (64, 128)
    poisson_requests: int = 40
    poisson_repeats: int = 3  # rounds of the Poisson load (each system once per round; the median round is kept)
    poisson_load: float = 0.8  # fraction of REQUEST_BATCH serial capacity
    poisson_systems: tuple = ("rb_serial", "rb_fused_wait", "step", "step_srpt", "step_deadline")
    mixed_sizes_systems: tuple = ("rb_fused_wait", "step", "step_mixed")
    mixed_sizes_repeats: int = 3  # rounds of the mixed-sizes point, as poisson_repeats
    systems: tuple = ("rb_serial", "rb_fused", "rb_fused_wait", "step", "naive")
    perf_analyzer_concurrency: int = 4
    perf_analyzer_requests: int = 24
    slo_factor: float = 3.0
    # "Other pipelines (tiny presets)": serial vs continuous on each pipeline's own server, after the main run.
    other_pipelines: tuple = ("flux", "sd3")
    other_size: int = 64
    other_steps: int = 4
    other_concurrencies: tuple = (1, 8)
    other_rounds: int = 2  # per point: max(other_rounds x concurrency, other_min_requests) requests
    other_min_requests: int = 8
    other_max_sequence_length: int = 32


FULL = Plan("full")
QUICK = Plan("quick", steps=4, concurrencies=(1, 8), rounds=2, repeats=2, mixed_step_choices=(2, 4, 8),
             mixed_sizes=(64, 128), poisson_requests=12, poisson_repeats=1, mixed_sizes_repeats=1,
             poisson_systems=("rb_serial", "step", "step_srpt", "step_deadline"),
             mixed_sizes_systems=("step",), systems=("rb_serial", "rb_fused_wait", "step", "naive"),
             perf_analyzer_concurrency=8, perf_analyzer_requests=8, preview_interval=2)


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------------------
# Machine and load


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def wait_for_quiet(max_load: float, max_wait_s: float) -> list[float]:
    """Wait (up to max_wait_s) until the 1-minute load is below max_load, so numbers are not distorted."""
    deadline = time.monotonic() + max_wait_s
    while True:
        load = loadavg()
        if not load or load[0] < max_load or time.monotonic() >= deadline:
            return load
        log(f"1-minute load {load[0]:.2f} >= {max_load}; waiting")
        time.sleep(20)


def machine_info() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    import diffusers
    import torch

    return {"nproc": os.cpu_count(), "cpu_model": cpu, "ram_gib": mem_gib, "python": platform.python_version(),
            "torch": torch.__version__, "diffusers": diffusers.__version__, "platform": platform.platform(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


# ---------------------------------------------------------------------------
# One system


def measure(running: systems.RunningSystem, run_fn: Callable[[], loadgen.RunResult], solo: Optional[dict],
            slo_factor: float) -> dict:
    """A load-generator run's summary, plus what the server did meanwhile: batch sizes (its metrics),
    the CPU split between load generator, tritonserver and the model process, and the machine load."""
    load = loadavg()
    before, cpu_before = systems.scrape_metrics(running.server.metrics_url), cpu_split(running.pid)
    run = run_fn()
    cpu_after = cpu_split(running.pid)
    summary = loadgen.summarize(run, solo, slo_factor)
    summary["server"] = systems.batch_stats(before, systems.scrape_metrics(running.server.metrics_url))
    summary["cpu_s"] = {k: cpu_after[k] - cpu_before[k] for k in cpu_after}
    summary["load_at_start"] = load
    return summary


def closed_point(running: systems.RunningSystem, specs: list, concurrency: int, solo: Optional[dict],
                 slo_factor: float, tag: str) -> dict:
    return measure(running, lambda: loadgen.run_closed_loop(running.target, specs, concurrency, tag=tag),
                   solo, slo_factor)


def calibrate_solo(running: systems.RunningSystem, specs: Sequence, repeats: int = 2) -> dict:
    """Median latency of each distinct request shape alone on the server: shape_key -> seconds."""
    solo = {}
    for spec in workloads.distinct_shapes(specs):
        run = loadgen.run_closed_loop(running.target, [spec] * repeats, 1, tag=f"solo-{spec.shape_key}")
        latencies = [r.latency for r in run.records if r.ok]
        if not latencies:
            raise RuntimeError(f"solo calibration of {spec.shape_key} failed: "
                               f"{[r.check_error() for r in run.records]}")
        solo[spec.shape_key] = statistics.median(latencies)
    return solo


def warm_up(running: systems.RunningSystem, plan: Plan) -> None:
    """First-request and first-batch-shape effects, for every system alike (not measured)."""
    warm = workloads.uniform(plan.max_num_seqs, plan.size, plan.steps, plan.preview_interval, seed=99)
    loadgen.run_closed_loop(running.target, warm[:1], 1, tag="warm1")
    loadgen.run_closed_loop(running.target, warm, plan.max_num_seqs, tag="warm")


def poisson_point(running: systems.RunningSystem, ctx: dict, plan: Plan) -> dict:
    """The Poisson load; a system in deadline order gets each request's SLO as its Triton timeout (the others
    none, as before it existed; `make bench-slo` compares both ways)."""
    slo_s = sent_slos(running.system, ctx["solo"], plan.slo_factor)
    return measure(running, lambda: loadgen.run_open_loop(running.target, ctx["poisson_specs"], ctx["poisson_rate"],
                                                          seed=POISSON_ARRIVAL_SEED, slo_s=slo_s),
                   ctx["solo"], plan.slo_factor)


def sent_slos(system: systems.System, solo: dict, slo_factor: float) -> Optional[dict]:
    """The SLOs the Poisson load sends as Triton timeouts to `system`: to a system in deadline order only."""
    return slo_budgets(solo, slo_factor) if system.parameters.get("admission_order") == "deadline" else None


def run_perf_analyzer(running: systems.RunningSystem, plan: Plan) -> dict:
    """perf_analyzer at one concurrency, between two load-generator runs of the same shape and concurrency.

    Back to back, so the comparison is not skewed by load that changes over minutes.
    """
    c, n = plan.perf_analyzer_concurrency, plan.perf_analyzer_requests
    spec = workloads.uniform(1, plan.size, plan.steps, plan.preview_interval)[0]
    loadgen_means = []

    def loadgen_point(tag: str) -> None:
        specs = [spec] * n  # exactly what perf_analyzer sends
        summary = loadgen.summarize(loadgen.run_closed_loop(running.target, specs, c, tag=tag))
        if summary["latency_mean_s"] is not None:
            loadgen_means.append(summary["latency_mean_s"])

    loadgen_point("pa-before")
    try:
        pa = perf_analyzer.run(running.target.url, running.target.model, spec, c, n)
    except (OSError, ValueError, RuntimeError, subprocess.SubprocessError) as exc:
        return {"error": str(exc), "explanation": perf_analyzer.EXPLANATION}
    loadgen_point("pa-after")
    pa["loadgen_mean_latencies_s"] = loadgen_means
    pa["comparison"] = perf_analyzer.compare(pa, statistics.mean(loadgen_means) if loadgen_means else None)
    log(f"perf_analyzer c={c}: {json.dumps(pa.get('summary', pa.get('error')))}; avg latency matches the "
        f"{pa.get('avg_latency_matches')}; e2e vs loadgen {json.dumps(pa['comparison'])}")
    return pa


def fmt_dict(d: dict) -> str:
    return ", ".join(f"{k}: {v:.2f}" for k, v in d.items())


# ---------------------------------------------------------------------------
# The whole run


def other_pipelines(plan: Plan, log_dir: Path) -> dict:
    """Each other pipeline's tiny preset: REQUEST_BATCH serial, then STEP_BATCH continuous, one server at a time.

    The same closed-loop uniform workload at each concurrency; shows both modes work end to end on every
    pipeline (tiny random weights: not model speed).
    """
    from engine_lib.tiny_models import ensure_model

    out: dict = {}
    for pipeline in plan.other_pipelines:
        model_path = ensure_model(pipeline, "tiny")
        section = out[pipeline] = {"preset": "tiny", "systems": {}}
        for system in systems.tiny_pipeline_systems(pipeline, plan.max_num_seqs, plan.device, plan.dtype,
                                                    plan.other_max_sequence_length):
            start = time.perf_counter()
            entry = section["systems"][system.name] = {"name": system.name, "label": system.label,
                                                       "parameters": dict(system.parameters), "closed": {}}
            with systems.serve(system, model_path, log_dir=log_dir) as rs:
                entry["startup_s"] = time.perf_counter() - start
                warm_up(rs, replace(plan, size=plan.other_size, steps=plan.other_steps))
                for c in plan.other_concurrencies:
                    n = max(plan.other_rounds * c, plan.other_min_requests)
                    specs = workloads.uniform(n, plan.other_size, plan.other_steps, plan.preview_interval, seed=200)
                    entry["closed"][str(c)] = closed_point(rs, specs, c, None, plan.slo_factor, f"{pipeline}-c{c}")
            log(f"{system.name}: req/s " + ", ".join(
                f"c={c} {p['requests_per_s'] or 0:.3f} ({p['errors']} errors)" for c, p in entry["closed"].items()))
    return out


def run(plan: Plan, out_path: Path, max_load: float, max_wait_s: float, with_offline: bool = True) -> dict:
    """Every system on its own server, all started up front, measured interleaved (see module docstring)."""
    from engine_lib.tiny_models import ensure_model

    t0 = time.perf_counter()
    model_path = ensure_model("qwen_image", plan.preset)
    load_before = wait_for_quiet(max_load, max_wait_s)
    log(f"plan {plan.name}; load {load_before}; model {model_path}")
    mixed = poisson_specs(plan.poisson_requests, plan.size, plan.mixed_step_choices, plan.preview_interval)
    sizes = workloads.mixed_sizes(plan.rounds * max(plan.concurrencies), plan.mixed_sizes, plan.steps,
                                  plan.preview_interval, seed=7)
    all_specs = workloads.uniform(1, plan.size, plan.steps, plan.preview_interval) + mixed + sizes
    ctx: dict = {"poisson_specs": mixed}
    results: dict = {"plan": asdict(plan), "machine": machine_info(), "load_before": load_before,
                     "started": time.strftime("%Y-%m-%d %H:%M:%S"), "systems": {}}
    log_dir = Path(os.environ.get("BENCH_LOG_DIR", "/tmp/bench-logs"))
    by_name = {s.name: s for s in systems.default_systems(plan.max_num_seqs, plan.wait_ms, plan.device, plan.dtype)}
    closed = list(dict.fromkeys(("rb_serial",) + plan.systems))  # serial calibrates the SLO
    names = list(dict.fromkeys(closed + list(plan.poisson_systems + plan.mixed_sizes_systems)))
    S = results["systems"]
    with contextlib.ExitStack() as stack:
        running: dict[str, systems.RunningSystem] = {}
        for name in names:
            system, start = by_name[name], time.perf_counter()
            S[name] = {"name": name, "label": system.label, "parameters": dict(system.parameters),
                       "streaming": system.streaming, "load_at_start": loadavg(), "closed": {}}
            running[name] = stack.enter_context(systems.serve(system, model_path, log_dir=log_dir))
            S[name]["startup_s"] = time.perf_counter() - start
            log(f"{name}: server ready in {S[name]['startup_s']:.1f} s")
        rss = stack.enter_context(PeakRssSampler({n: r.pid for n, r in running.items()}))
        limit = None
        if with_offline:
            limit = offline.OfflineLimit(offline.load_adapter(model_path, plan.device, plan.dtype), plan.size,
                                         plan.steps, sorted({1, plan.max_num_seqs}))
            limit.warm()
        for rs in running.values():
            warm_up(rs, plan)
        ctx["solo"] = calibrate_solo(running["rb_serial"], all_specs)
        ctx["poisson_rate"] = poisson_rate(ctx["solo"], mixed, plan.poisson_load)
        log(f"solo latencies (REQUEST_BATCH serial) {fmt_dict(ctx['solo'])}; Poisson rate "
            f"{ctx['poisson_rate']:.3f}/s = {plan.poisson_load:.0%} of serial capacity")
        # Interleaved: each (repeat, concurrency) point runs on every system back to back.
        for r in range(plan.repeats):
            for c in plan.concurrencies:
                specs = workloads.uniform(max(plan.rounds * c, 2), plan.size, plan.steps, plan.preview_interval,
                                          seed=100 + r)
                for name in closed:
                    point = closed_point(running[name], specs, c, ctx["solo"], plan.slo_factor, f"c{c}r{r}")
                    S[name]["closed"].setdefault(str(c), []).append(point)
                log(f"repeat {r} c={c} req/s " + ", ".join(
                    f"{n} {S[n]['closed'][str(c)][-1]['requests_per_s'] or 0:.3f}" for n in closed))
            if limit is not None:
                limit.sample()
            save(results, out_path)
        c = max(plan.concurrencies)
        for r in range(plan.mixed_sizes_repeats):
            for name in (n for n in plan.mixed_sizes_systems if n in running):
                point = closed_point(running[name], sizes, c, ctx["solo"], plan.slo_factor, f"ms{r}")
                S[name].setdefault("mixed_sizes_points", []).append(point)
                log(f"{name}: mixed sizes round {r} c={c} req/s {point['requests_per_s']}")
        for r in range(plan.poisson_repeats):
            round_ctx = {**ctx, **poisson_calibration(running["rb_serial"], mixed, plan.poisson_load)}
            for name in (n for n in plan.poisson_systems if n in running):
                point = poisson_point(running[name], round_ctx, plan)
                point["solo_latency_s"] = round_ctx["solo"]
                S[name].setdefault("poisson_points", []).append(point)
                log(f"{name}: Poisson round {r} {round_ctx['poisson_rate']:.3f}/s p99 {point['latency_p99_s']} s "
                    f"SLO {point.get('slo_attainment')} errors {point['errors']}")
            save(results, out_path)
        for entry in S.values():
            if entry.get("mixed_sizes_points"):
                entry["mixed_sizes"] = median_point(entry["mixed_sizes_points"], "requests_per_s")
            if entry.get("poisson_points"):
                entry["poisson"] = median_point(entry["poisson_points"], "slo_attainment")
        results["poisson_model"] = poisson_model(S, mixed, plan.slo_factor)
        if "step" in running and plan.perf_analyzer_requests:
            S["step"]["perf_analyzer"] = run_perf_analyzer(running["step"], plan)
        rss.sample_once()
        for name in running:
            S[name]["peak_rss_bytes"] = rss.peak_bytes[name]
    results["solo_latency_s"] = ctx["solo"]
    results["poisson_rate"] = ctx["poisson_rate"]
    if limit is not None:
        log(f"offline: phase profile at batch 1 and {plan.max_num_seqs}")
        import torch

        results["offline"] = {"torch_threads": torch.get_num_threads(), "limit": limit.summary(),
                              "profile": offline.phase_profile(limit.adapter, plan.size, plan.steps,
                                                               plan.max_num_seqs)}
    if plan.other_pipelines:
        log(f"other pipelines (tiny presets): {', '.join(plan.other_pipelines)}")
        results["other_pipelines"] = other_pipelines(plan, log_dir)
    results["load_after"] = loadavg()
    results["wall_s"] = time.perf_counter() - t0
    save(results, out_path)
    log(f"done in {results['wall_s'] / 60:.1f} min; results {out_path}")
    return results


POISSON_ARRIVAL_SEED = 11  # the Poisson point's arrival times (`make bench`, `make bench-slo`, slo_model)


def poisson_specs(requests: int, size: int, step_choices: Sequence[int], preview_interval: int) -> list:
    """The Poisson point's mixed-steps requests (the same seed wherever that load is run or modelled)."""
    return workloads.mixed_steps(requests, size, step_choices, preview_interval, seed=3)


def median_point(points: Sequence[dict], key: str) -> dict:
    """The round whose `key` is the median (the lower middle of an even count): a whole run, so its latencies,
    percentiles and SLO attainment all come from one run of the same requests."""
    ordered = sorted(points, key=lambda p: (p.get(key) is None, p.get(key) or 0.0))
    return ordered[(len(ordered) - 1) // 2]


def poisson_calibration(serial: systems.RunningSystem, specs: Sequence, load: float) -> dict:
    """A Poisson round's own solo latencies (REQUEST_BATCH serial, idle, just before the round) and the rate that
    is `load` of the serial capacity they give: {"solo", "poisson_rate"}.

    Per round because this machine's speed drifts over minutes: a 128x128 8-step request took 0.30 s alone at
    one run's start and 0.45-0.52 s two hours later, so a rate fixed at a run's start loads a later round well
    above or below its nominal share (each point's engine-busy share shows the load it saw)."""
    solo = calibrate_solo(serial, specs)
    return {"solo": solo, "poisson_rate": poisson_rate(solo, specs, load)}


def poisson_model(entries: dict, specs: Sequence, slo_factor: float) -> Optional[dict]:
    """slo_model's bound for each Poisson round, read off the rounds of the first system that ran them."""
    from benchmarks import slo_model

    points = next((e["poisson_points"] for e in entries.values() if e.get("poisson_points")), None)
    return slo_model.round_bounds(points, specs, slo_factor) if points else None


def slo_budgets(solo: dict, slo_factor: float) -> dict:
    """shape key -> its SLO in seconds (slo_factor x its solo latency), as loadgen.summarize counts it."""
    return {key: slo_factor * seconds for key, seconds in solo.items()}


def poisson_rate(solo: dict, specs: Sequence, load: float) -> float:
    """`load` x the serial capacity for this workload: 1 / mean solo service time."""
    mean_service = statistics.mean(solo[s.shape_key] for s in specs)
    return load / mean_service


def interleaved_points(system_list: Sequence[systems.System], model_path: Path, plan: Plan, concurrency: int,
                       repeats: int, specs_for: Callable[[int], list], tag: str,
                       log_dir: Optional[Path] = None, after_repeat: Optional[Callable[[int], None]] = None) -> dict:
    """A side benchmark's systems side by side: start and warm each, then for every repeat run the same
    closed-loop requests (`specs_for(repeat)`) on each back to back, then `after_repeat(repeat)` (a measurement
    that should see the same machine load, such as an offline limit). {name: {"label", "points", medians}}."""
    out: dict = {}
    with contextlib.ExitStack() as stack:
        running = {s.name: stack.enter_context(systems.serve(s, model_path, log_dir=log_dir)) for s in system_list}
        for name, rs in running.items():
            warm_up(rs, plan)
            out[name] = {"label": rs.system.label, "points": []}
        for r in range(repeats):
            specs = specs_for(r)
            for name, rs in running.items():
                point = closed_point(rs, specs, concurrency, None, plan.slo_factor, f"{tag}-{name}-{r}")
                out[name]["points"].append(point)
                log(f"repeat {r} {name}: {point['requests_per_s']:.3f} req/s, mean batch "
                    f"{point['server'].get('mean_batch_size', 0):.2f}, errors {point['errors']}")
            if after_repeat is not None:
                after_repeat(r)
    for entry in out.values():
        entry["requests_per_s_median"] = statistics.median(p["requests_per_s"] or 0 for p in entry["points"])
        entry["mean_batch_size_median"] = statistics.median(p["server"].get("mean_batch_size", 0)
                                                            for p in entry["points"])
        entry["latency_p99_s_median"] = statistics.median(p.get("latency_p99_s") or 0 for p in entry["points"])
    return out


def save_and_report(results: dict, name: str, headline: str, render: bool = True) -> None:
    """A side benchmark's ending: benchmarks/results/<name>.json, one log line, docs/benchmarks.md re-rendered."""
    path = RESULTS_DIR / f"{name}.json"
    save(results, path)
    log(f"{headline}; results {path}")
    if render:
        report.write_report()


def side_main(doc: str, name: str, run: Callable[..., dict], headline: Callable[[dict], str],
              argv: Optional[Sequence[str]] = None, option: tuple[str, int] = ("repeats", 3)) -> int:
    """The command line of a side benchmark (`make bench-lora`, ...): its one count option (`--repeats` or the
    like), `--no-report`; runs it, saves benchmarks/results/<name>.json and re-renders docs/benchmarks.md."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument(f"--{option[0]}", type=int, default=option[1])
    parser.add_argument("--no-report", action="store_true", help="do not re-render docs/benchmarks.md")
    args = parser.parse_args(argv)
    results = run(**{option[0]: getattr(args, option[0])}, log_dir=Path("/tmp/bench-logs"))
    save_and_report(results, name, headline(results), render=not args.no_report)
    return 0


def save(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str) + "\n")
    tmp.replace(path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the under-5-minute plan")
    parser.add_argument("--systems", default=None, help="comma-separated subset (rb_serial always runs)")
    parser.add_argument("--preset", default=None, help="model preset (default: bench)")
    parser.add_argument("--device", default=None, help="cpu (default) or cuda")
    parser.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16")
    parser.add_argument("--size", type=int, default=None, help="image size of the uniform workload")
    parser.add_argument("--steps", type=int, default=None, help="steps of the uniform workload")
    parser.add_argument("--concurrencies", default=None, help="comma-separated closed-loop concurrencies")
    parser.add_argument("--repeats", type=int, default=None, help="closed-loop repeats per point")
    parser.add_argument("--poisson-requests", type=int, default=None)
    parser.add_argument("--poisson-repeats", type=int, default=None, help="rounds of the Poisson and mixed-sizes loads")
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results/<plan>.json)")
    parser.add_argument("--no-offline", action="store_true", help="skip the in-process offline limit")
    parser.add_argument("--other-pipelines", default=None,
                        help="comma-separated tiny-preset pipelines after the main run (default flux,sd3; '' skips)")
    parser.add_argument("--no-report", action="store_true", help="do not regenerate docs/benchmarks.md")
    parser.add_argument("--doc", default=None, help="write the report here instead of docs/benchmarks.md "
                        "(the results of this run are rendered, not the newest full/quick ones)")
    parser.add_argument("--max-load", type=float, default=1.5, help="wait until the 1-minute load is below this")
    parser.add_argument("--max-wait", type=float, default=600.0, help="... for at most this many seconds")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.systems:
        subset = tuple(s.strip() for s in args.systems.split(",") if s.strip())
        plan = replace(plan, systems=subset, poisson_systems=tuple(s for s in plan.poisson_systems if s in subset),
                       mixed_sizes_systems=tuple(s for s in plan.mixed_sizes_systems if s in subset))
    overrides = {"preset": args.preset, "device": args.device, "dtype": args.dtype, "size": args.size, "steps": args.steps, "repeats": args.repeats,
                 "poisson_requests": args.poisson_requests, "poisson_repeats": args.poisson_repeats,
                 "mixed_sizes_repeats": args.poisson_repeats,
                 "concurrencies": tuple(int(c) for c in args.concurrencies.split(",")) if args.concurrencies else None}
    plan = replace(plan, **{k: v for k, v in overrides.items() if v is not None})
    if args.other_pipelines is not None:
        plan = replace(plan, other_pipelines=tuple(p.strip() for p in args.other_pipelines.split(",") if p.strip()))
    out = Path(args.out) if args.out else RESULTS_DIR / f"{plan.name}.json"
    try:
        results = run(plan, out, args.max_load, args.max_wait, with_offline=not args.no_offline)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    if not args.no_report:
        paths = report.write_report(out, Path(args.doc)) if args.doc else report.write_report()
        log(f"report: {', '.join(str(p) for p in paths)}")
    print(report.headline(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
