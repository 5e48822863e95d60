"""`make bench-slo`: the Poisson mixed-steps load with each request's SLO sent as its deadline, side by side.

The workload of `make bench`'s Poisson point (bench Qwen-Image at 128x128, steps drawn from 4, 8 and
16, 40 requests, Poisson arrivals at 80 % of REQUEST_BATCH serial capacity, the same seeds); the SLO
is 3x the solo latency of the request's shape. Both are calibrated on a REQUEST_BATCH serial server just
before each round (run.poisson_calibration), as `make bench` does. Every
request carries its SLO as Triton's request timeout (what a client that has a deadline sends):
a request not started by then ends with a timeout error, and `admission_order=deadline` orders by
it. Systems, each its own tritonserver, one after the other, `repeats` rounds:

- step_srpt: STEP_BATCH x2, shortest remaining first (`make bench`'s best), without deadlines;
- step_srpt_timeouts: the same with deadlines sent (late requests that never started are dropped);
- step_deadline: STEP_BATCH x2, `admission_order=deadline` (earliest deadline first among requests
  that can still make theirs, the rest after; a second request shares steps only where that pays),
  `max_preemptions=3`, deadlines sent.

Also `benchmarks/slo_model.py`'s bound for the sequence at each round's calibration. Results:
benchmarks/results/slo.json; docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

from benchmarks import loadgen, slo_model, systems
from benchmarks.run import (FULL, POISSON_ARRIVAL_SEED, log, machine_info, measure, poisson_calibration, poisson_specs,
                            side_main, slo_budgets, warm_up)

# Earliest deadline first preempts more often than shortest remaining (a more pressing arrival pauses a running
# request): `step_deadline` (benchmarks/systems.py) has max_preemptions=3. Medians of 3 rounds here, deadline order:
# x2 with 3 preemptions 92.5 % (6 rounds, 87.5-95), with 1 90 %, with 8 90 %; x1 with 8 90 %; x3 with 1 87.5 %
# (session 11, before deadline order shared steps only where that pays).
SENT = {"step_srpt_timeouts", "step_deadline"}  # the systems whose requests carry their SLO as a timeout


def slo_systems() -> list[systems.System]:
    by_name = {s.name: s for s in systems.default_systems(device="cpu", dtype="float32")}
    srpt = by_name["step_srpt"]
    return [srpt, replace(srpt, name="step_srpt_timeouts", label=srpt.label + ", SLOs sent as timeouts"),
            by_name["step_deadline"]]


def run(repeats: int = 2, preset: str = FULL.preset, log_dir: Optional[Path] = None) -> dict:
    from engine_lib.tiny_models import ensure_model

    plan = replace(FULL, preset=preset)
    model_path = ensure_model("qwen_image", plan.preset)
    specs = poisson_specs(plan.poisson_requests, plan.size, plan.mixed_step_choices, plan.preview_interval)
    results = {"kind": "slo", "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(),
               "workload": {"preset": preset, "requests": len(specs), "size": plan.size,
                            "steps": list(plan.mixed_step_choices), "load": plan.poisson_load,
                            "slo_factor": plan.slo_factor, "repeats": repeats},
               "systems": {}}
    serial = next(s for s in systems.default_systems(plan.max_num_seqs, plan.wait_ms, "cpu", "float32")
                  if s.name == "rb_serial")
    with contextlib.ExitStack() as stack:
        calibrator = stack.enter_context(systems.serve(serial, model_path, log_dir=log_dir))
        running = {s.name: stack.enter_context(systems.serve(s, model_path, log_dir=log_dir)) for s in slo_systems()}
        for rs in (calibrator, *running.values()):
            warm_up(rs, plan)
        for r in range(repeats):
            calibration = poisson_calibration(calibrator, specs, plan.poisson_load)  # this round's rate and SLOs
            solo, rate = calibration["solo"], calibration["poisson_rate"]
            log(f"round {r}: solo latencies {solo}; Poisson rate {rate:.3f}/s")
            for name, rs in running.items():
                slo_s = slo_budgets(solo, plan.slo_factor) if name in SENT else None
                point = measure(rs, lambda: loadgen.run_open_loop(rs.target, specs, rate, seed=POISSON_ARRIVAL_SEED,
                                                                  tag=f"{name}{r}", slo_s=slo_s), solo, plan.slo_factor)
                point["solo_latency_s"] = solo
                entry = results["systems"].setdefault(name, {"label": rs.system.label, "points": []})
                entry["points"].append(point)
                log(f"{name} repeat {r}: SLO {point.get('slo_attainment')}, errors {point['errors']}")
    # The first round's calibration is the run's; every point keeps its round's (slo_model bounds each round).
    points = next(iter(results["systems"].values()))["points"]
    results.update(solo_latency_s=points[0]["solo_latency_s"], poisson_rate=points[0]["offered_rate"])
    for entry in results["systems"].values():
        entry["slo_attainment_median"] = statistics.median(p["slo_attainment"] for p in entry["points"])
    results["poisson_model"] = slo_model.round_bounds(points, specs, plan.slo_factor)
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    return side_main(__doc__, "slo", run, lambda r: "SLO attainment: " + ", ".join(
        f"{name} {e['slo_attainment_median']:.0%}" for name, e in r["systems"].items()), argv, option=("repeats", 2))


if __name__ == "__main__":
    raise SystemExit(main())
