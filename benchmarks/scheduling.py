"""`make bench-scheduling` and benchmarks/device.sh: issue #13's three scheduling targets, the engine in-process.

The workloads, systems and statistics of `make bench` (mixed sizes 64/128 at concurrency 16, step vs
fused; the Poisson mixed-steps load at 80 % of REQUEST_BATCH serial capacity, SLO 3x the solo
latency) and of `make bench-priority` (an urgent request under a full background load, p99 against
alone), with each system's engine in this process (benchmarks/in_process.py) instead of behind a
tritonserver. Why: these are the targets a 2-CPU machine cannot settle, and the GPU machine lent to
sessions cannot run tritonserver (docs/benchmarks.md "GPU"). On this CPU it is a cross-check of
`make bench`: the same engine and workloads without the transport.

Order: load the pipeline (once per set of adapter options: every system here but `step_mixed` shares
one); warm each system; calibrate the solo latency of every shape on REQUEST_BATCH serial; then the mixed sizes and the Poisson load in rounds (each round every system
once, a fresh engine per point, the Poisson rate recalibrated before each round, as `make bench`);
then the urgent requests alone and under load.
Results go to benchmarks/results/scheduling[-gpu].json, saved after every stage (a run cut short
keeps what it measured); docs/benchmarks.md shows them.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

from benchmarks import loadgen, priority, report, systems, workloads
from benchmarks.in_process import InProcessSystem
from benchmarks.run import (FULL, POISSON_ARRIVAL_SEED, RESULTS_DIR, calibrate_solo, log, machine_info,
                            poisson_calibration, poisson_model, poisson_rate, poisson_specs, save, sent_slos, warm_up)


@dataclass(frozen=True)
class SchedulingPlan:
    """Sizes and counts; the workloads are `make bench`'s and `make bench-priority`'s unless a plan changes them."""

    name: str
    preset: str = FULL.preset
    device: str = "cpu"
    dtype: str = "float32"
    max_num_seqs: int = FULL.max_num_seqs
    wait_ms: float = FULL.wait_ms
    repeats: int = 3  # rounds of the mixed sizes and of the Poisson load
    mixed_sizes: tuple = FULL.mixed_sizes
    mixed_steps: int = FULL.steps
    concurrency: int = max(FULL.concurrencies)
    mixed_rounds: int = FULL.rounds  # each point: this x concurrency requests
    size: int = FULL.size  # the Poisson load's
    step_choices: tuple = FULL.mixed_step_choices
    poisson_requests: int = FULL.poisson_requests
    poisson_load: float = FULL.poisson_load
    slo_factor: float = FULL.slo_factor
    preview_interval: int = FULL.preview_interval
    urgent_requests: int = 30
    urgent_background: int = 8
    urgent_max_num_seqs: int = 4
    urgent_size: int = 64
    urgent_steps: int = 8
    urgent_gap_s: float = 0.2


CPU = SchedulingPlan("cpu")
# The lent H200 (benchmarks/device.sh): the same workloads on the larger `gpu` preset in bfloat16.
GPU = SchedulingPlan("gpu", preset="gpu", device="cuda", dtype="bfloat16")
# Tests: every stage once, in seconds.
SMOKE = SchedulingPlan("smoke", preset="tiny", repeats=1, mixed_steps=2, concurrency=4, mixed_rounds=1, size=64,
                       step_choices=(2, 3), poisson_requests=4, poisson_load=0.5, urgent_requests=2,
                       urgent_background=2, urgent_max_num_seqs=2, urgent_steps=2, urgent_gap_s=0.0)
PLANS = {plan.name: plan for plan in (CPU, GPU, SMOKE)}

MIXED_SIZES_SYSTEMS = ("rb_fused_wait", "step", "step_mixed")
POISSON_SYSTEMS = ("rb_serial", "step", "step_srpt", "step_deadline")
URGENT_SYSTEMS = ("priority_preempt", "priority_separate")  # benchmarks/priority.py


def plan_systems(plan: SchedulingPlan) -> dict[str, systems.System]:
    served = systems.default_systems(plan.max_num_seqs, plan.wait_ms, plan.device, plan.dtype)
    urgent = priority.priority_systems(plan.urgent_max_num_seqs, plan.device, plan.dtype)
    wanted = set(MIXED_SIZES_SYSTEMS + POISSON_SYSTEMS + URGENT_SYSTEMS)
    return {s.name: s for s in served + urgent if s.name in wanted}


def point(system: InProcessSystem, run_fn: Callable[[loadgen.Target], loadgen.RunResult], solo: Optional[dict],
          slo_factor: float) -> dict:
    """One load-generator run on a fresh engine: loadgen's summary, plus the engine's batch statistics."""
    with system.running() as running:
        run = run_fn(running.target)
        stats = running.tally.stats()
    summary = loadgen.summarize(run, solo, slo_factor)
    summary["server"] = stats
    return summary


def urgent_latencies(system: InProcessSystem, plan: SchedulingPlan, loaded: bool) -> dict:
    """`make bench-priority`'s foreground: urgent requests one after another, with or without the background."""
    base = workloads.uniform(1, plan.urgent_size, plan.urgent_steps, seed=7)[0]
    urgent = [replace(spec, priority=1) for spec in workloads.uniform(plan.urgent_requests, plan.urgent_size,
                                                                       plan.urgent_steps, seed=8)]
    with system.running() as running, contextlib.ExitStack() as load:
        background = load.enter_context(priority.background_load(
            running.target, replace(base, priority=3), plan.urgent_background, "bg")) if loaded else []
        latencies = priority.foreground(running.target, urgent, plan.urgent_gap_s, "urgent")
    entry = priority.summary(latencies)
    entry["background_completed"] = sum(1 for r in background if r.ok)
    return entry


def run(plan: SchedulingPlan, out_path: Path) -> dict:
    from engine_lib.tiny_models import ensure_model

    t0 = time.perf_counter()
    model_path = ensure_model("qwen_image", plan.preset)
    results: dict = {"kind": "scheduling", "plan": asdict(plan), "machine": machine_info(),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S"), "systems": {}}
    loaded: dict[str, InProcessSystem] = {}
    adapters: dict = {}  # systems that differ only in engine parameters share their weights
    for name, system in plan_systems(plan).items():
        start = time.perf_counter()
        loaded[name] = InProcessSystem(system, model_path, adapters)
        with loaded[name].running() as running:  # first-request and first-batch-shape effects, not measured
            warm_up(running, replace(FULL, size=plan.size, steps=plan.mixed_steps, max_num_seqs=plan.max_num_seqs,
                                     preview_interval=plan.preview_interval))
        results["systems"][name] = {"label": system.label, "parameters": dict(system.parameters),
                                    "load_s": time.perf_counter() - start}
        log(f"{name}: loaded and warm in {results['systems'][name]['load_s']:.1f} s")
    S = results["systems"]
    mixed_specs = poisson_specs(plan.poisson_requests, plan.size, plan.step_choices, plan.preview_interval)
    size_specs = workloads.mixed_sizes(plan.mixed_rounds * plan.concurrency, plan.mixed_sizes, plan.mixed_steps,
                                       plan.preview_interval, seed=7)
    with loaded["rb_serial"].running() as serial:
        solo = calibrate_solo(serial, mixed_specs + size_specs)
    rate = poisson_rate(solo, mixed_specs, plan.poisson_load)
    results.update(solo_latency_s=solo, poisson_rate=rate)
    log(f"solo latencies {solo}; Poisson rate {rate:.3f}/s = {plan.poisson_load:.0%} of serial capacity")
    save(results, out_path)
    for r in range(plan.repeats):
        for name in MIXED_SIZES_SYSTEMS:
            p = point(loaded[name], lambda target: loadgen.run_closed_loop(target, size_specs, plan.concurrency,
                                                                           tag=f"ms{r}"), solo, plan.slo_factor)
            S[name].setdefault("mixed_sizes_points", []).append(p)
            log(f"{name}: mixed sizes round {r} req/s {p['requests_per_s']}, errors {p['errors']}")
        save(results, out_path)
    for r in range(plan.repeats):
        with loaded["rb_serial"].running() as serial:  # this round's rate (run.poisson_calibration)
            calibration = poisson_calibration(serial, mixed_specs, plan.poisson_load)
        for name in POISSON_SYSTEMS:
            slo_s = sent_slos(loaded[name].system, calibration["solo"], plan.slo_factor)
            p = point(loaded[name], lambda target: loadgen.run_open_loop(
                target, mixed_specs, calibration["poisson_rate"], seed=POISSON_ARRIVAL_SEED, tag=f"p{r}", slo_s=slo_s),
                calibration["solo"], plan.slo_factor)
            p["solo_latency_s"] = calibration["solo"]
            S[name].setdefault("poisson_points", []).append(p)
            log(f"{name}: Poisson round {r} SLO {p['slo_attainment']}, p99 {p['latency_p99_s']}, errors {p['errors']}")
        results["poisson_model"] = poisson_model(S, mixed_specs, plan.slo_factor)
        save(results, out_path)
    urgent = results["urgent"] = {"alone": urgent_latencies(loaded["priority_preempt"], plan, loaded=False)}
    for name in URGENT_SYSTEMS:
        urgent[name] = urgent_latencies(loaded[name], plan, loaded=True)
        urgent[name]["p99_over_alone_p99"] = urgent[name]["p99_s"] / urgent["alone"]["p99_s"]
        log(f"{name}: urgent p99 {urgent[name]['p99_s']:.3f} s, {urgent[name]['p99_over_alone_p99']:.2f}x alone")
    results["wall_s"] = time.perf_counter() - t0
    save(results, out_path)
    log(f"done in {results['wall_s'] / 60:.1f} min; results {out_path}")
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", choices=sorted(PLANS), default="cpu",
                        help="cpu: the bench preset on this machine; gpu: the gpu preset in bfloat16 on CUDA")
    parser.add_argument("--repeats", type=int, default=None, help="rounds of the mixed sizes and the Poisson load")
    parser.add_argument("--out", default=None, help="default benchmarks/results/scheduling[-<plan>].json")
    parser.add_argument("--no-report", action="store_true", help="do not re-render docs/benchmarks.md")
    args = parser.parse_args(argv)
    plan = PLANS[args.plan]
    if args.repeats is not None:
        plan = replace(plan, repeats=args.repeats)
    out = Path(args.out) if args.out else RESULTS_DIR / ("scheduling.json" if plan.name == "cpu"
                                                         else f"scheduling-{plan.name}.json")
    results = run(plan, out)
    print(report.scheduling_headline(results))
    if not args.no_report:
        report.write_report()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
