"""`make bench-bagel`: BAGEL (our own model code) with step batching at concurrency 4 vs serial, side by side.

Workload: the tiny BAGEL preset (the golden checkpoint), 64x64, 8 steps, text CFG on
(BAGEL's default scale 4: two rows per request), closed loop at concurrency 4, on two
servers: `max_num_seqs=1` (serial: one request per forward) and `max_num_seqs=4`
(requests join between steps; each row attends to its own prompt cache). Rounds are
interleaved. Results go to benchmarks/results/bagel.json; docs/benchmarks.md shows them.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

from benchmarks import systems, workloads
from benchmarks.run import QUICK, interleaved_points, machine_info, side_main


def bagel_systems(concurrency: int) -> list[systems.System]:
    engine = dict(device="cpu", dtype="float32", warmup="true", step_execution="true")
    return [systems.System(f"bagel_{name}", label, systems.MODEL_REPOSITORY, "bagel",
                           parameters={**engine, "max_num_seqs": str(seqs)})
            for name, label, seqs in (("serial", "serial (max_num_seqs=1)", 1),
                                      ("step", f"STEP_BATCH continuous x{concurrency}", concurrency))]


def run(concurrency: int = 4, size: int = 64, steps: int = 8, rounds: int = 16, repeats: int = 3,
        log_dir: Optional[Path] = None) -> dict:
    from engine_lib.tiny_models import ensure_model

    model_path = ensure_model("bagel", "tiny")
    results = {"kind": "bagel", "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(),
               "workload": {"concurrency": concurrency, "size": size, "steps": steps,
                            "requests_per_point": rounds * concurrency, "repeats": repeats}}
    plan = replace(QUICK, size=size, steps=steps, max_num_seqs=concurrency, preview_interval=0)
    results["systems"] = interleaved_points(
        bagel_systems(concurrency), model_path, plan, concurrency, repeats,
        lambda r: workloads.uniform(rounds * concurrency, size, steps, 0, seed=400 + r), "bagel", log_dir)
    rates = {name.removeprefix("bagel_"): entry["requests_per_s_median"] for name, entry in results["systems"].items()}
    results["step_over_serial"] = rates["step"] / rates["serial"] if rates["serial"] else None
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    return side_main(__doc__, "bagel", run, lambda r: f"step / serial: {r['step_over_serial']:.2f}x", argv)


if __name__ == "__main__":
    raise SystemExit(main())
