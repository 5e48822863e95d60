"""`make bench-own`: our own model code (BAGEL, HunyuanImage-3.0) with step batching at concurrency 4 vs serial.

Workload per pipeline: its tiny preset (the golden checkpoint), 64x64, 8 steps, CFG at
the model's default scale (two rows per request), closed loop at concurrency 4, on two
servers: `max_num_seqs=1` (serial: one request per forward) and `max_num_seqs=4`
(requests join between steps; each row attends to its own prompt cache). Rounds are
interleaved. Results go to benchmarks/results/own_models.json; docs/benchmarks.md shows them.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

from benchmarks import systems, workloads
from benchmarks.run import QUICK, interleaved_points, machine_info, side_main

PIPELINES = ("bagel", "hunyuan_image3")


def own_systems(pipeline: str, concurrency: int) -> list[systems.System]:
    engine = dict(device="cpu", dtype="float32", warmup="true", step_execution="true")
    return [systems.System(f"{pipeline}_{name}", label, systems.MODEL_REPOSITORY, pipeline,
                           parameters={**engine, "max_num_seqs": str(seqs)})
            for name, label, seqs in (("serial", f"{pipeline}: serial (max_num_seqs=1)", 1),
                                      ("step", f"{pipeline}: STEP_BATCH continuous x{concurrency}", concurrency))]


def run(concurrency: int = 4, size: int = 64, steps: int = 8, rounds: int = 16, repeats: int = 3,
        log_dir: Optional[Path] = None) -> dict:
    from engine_lib.tiny_models import ensure_model

    results = {"kind": "own_models", "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(),
               "workload": {"concurrency": concurrency, "size": size, "steps": steps,
                            "requests_per_point": rounds * concurrency, "repeats": repeats},
               "systems": {}, "step_over_serial": {}}
    plan = replace(QUICK, size=size, steps=steps, max_num_seqs=concurrency, preview_interval=0)
    for pipeline in PIPELINES:
        points = interleaved_points(
            own_systems(pipeline, concurrency), ensure_model(pipeline, "tiny"), plan, concurrency, repeats,
            lambda r: workloads.uniform(rounds * concurrency, size, steps, 0, seed=400 + r), pipeline, log_dir)
        results["systems"].update(points)
        serial, step = (points[f"{pipeline}_{name}"]["requests_per_s_median"] for name in ("serial", "step"))
        results["step_over_serial"][pipeline] = step / serial if serial else None
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    return side_main(__doc__, "own_models", run, lambda r: "step / serial: " + ", ".join(
        f"{name} {ratio:.2f}x" for name, ratio in r["step_over_serial"].items()), argv)


if __name__ == "__main__":
    raise SystemExit(main())
