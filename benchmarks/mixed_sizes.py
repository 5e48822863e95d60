"""`make bench-sizes`: mixed image sizes, fused request batching vs step batching with and without
`mixed_size_batching`, side by side in one run.

Workload: Qwen-Image, sizes drawn from 64 and 128, 8 steps, closed loop at concurrency 16,
`max_num_seqs` 8 everywhere: REQUEST_BATCH fused with a 20 ms admission wait (waves of one size),
STEP_BATCH with the size in the step key (head bypass on), and STEP_BATCH with
`mixed_size_batching=true` (any sizes share a forward, image tokens packed). Repeats are interleaved
between the servers. Then the offline limit of the same size mix: diffusers `pipe()` in batches of 8
of one size, at each size in fresh processes (benchmarks/efficiency.py), combined over the
workload's sizes: no server, no waiting, no size switches. It is measured after each repeat's
served points (the servers idle meanwhile), so it sees the machine they saw. The `tiny` and then the
`bench` preset, then the bench preset with five sizes (64 to 128 in steps of 16), where fused waves of
one size are shorter (VARIANTS). Results go to benchmarks/results/mixed_sizes.json; docs/benchmarks.md
shows them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

from benchmarks import efficiency, systems, workloads
from benchmarks.run import FULL, interleaved_points, machine_info, side_main


def size_systems(max_num_seqs: int) -> list[systems.System]:
    by_name = {s.name: s for s in systems.default_systems(max_num_seqs)}
    return [by_name[name] for name in ("rb_fused_wait", "step", "step_mixed")]


# name: (preset, sizes, closed-loop rounds of `concurrency` requests per point: a tiny point takes seconds, so it
# runs more of them). The first two are the mix; with five sizes a fused wave of one size is shorter.
VARIANTS = {"tiny": ("tiny", (64, 128), 12), "bench": ("bench", (64, 128), 3),
            "bench, five sizes": ("bench", (64, 80, 96, 112, 128), 3)}


def run_variants(repeats: int = 3, log_dir: Optional[Path] = None) -> dict:
    """`run` on each of VARIANTS, one after the other."""
    return {"kind": "mixed_sizes", "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(),
            "variants": {name: run(preset=preset, sizes=sizes, rounds=rounds, repeats=repeats, log_dir=log_dir)
                        for name, (preset, sizes, rounds) in VARIANTS.items()}}


def run(concurrency: int = 16, sizes: tuple = (64, 128), steps: int = 8, rounds: int = 3, repeats: int = 3,
        max_num_seqs: int = 8, preset: str = FULL.preset, log_dir: Optional[Path] = None) -> dict:
    from engine_lib.tiny_models import ensure_model

    model_path = ensure_model("qwen_image", preset)
    results = {"kind": "mixed_sizes", "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(),
               "workload": {"preset": preset, "concurrency": concurrency, "sizes": list(sizes), "steps": steps,
                            "requests_per_point": rounds * concurrency, "repeats": repeats,
                            "max_num_seqs": max_num_seqs}}
    plan = replace(FULL, preset=preset, steps=steps, max_num_seqs=max_num_seqs, preview_interval=0)

    def specs_for(r: int) -> list:
        return workloads.mixed_sizes(rounds * concurrency, sizes, steps, 0, seed=500 + r)

    offline: dict[int, list[float]] = {size: [] for size in sizes}

    def measure_offline(r: int) -> None:
        for size in sizes:
            offline[size].append(efficiency.offline_images_per_s(preset, size, 6 * efficiency.BATCH))

    with_offline = (steps, max_num_seqs) == (efficiency.STEPS, efficiency.BATCH)
    results["systems"] = interleaved_points(size_systems(max_num_seqs), model_path, plan, concurrency, repeats,
                                            specs_for, "sizes", log_dir, measure_offline if with_offline else None)
    fused = results["systems"]["rb_fused_wait"]["requests_per_s_median"]
    results["step_over_fused"] = {name: entry["requests_per_s_median"] / fused
                                  for name, entry in results["systems"].items() if name != "rb_fused_wait"}
    if with_offline:
        rate = {size: statistics.median(values) for size, values in offline.items()}
        specs = [spec for r in range(repeats) for spec in specs_for(r)]
        limit = len(specs) / sum(1 / rate[spec.height] for spec in specs)
        results["offline"] = {"images_per_s": offline, "limit_requests_per_s": limit}
        results["share_of_limit"] = {name: entry["requests_per_s_median"] / limit
                                     for name, entry in results["systems"].items()}
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    return side_main(__doc__, "mixed_sizes", run_variants, lambda r: "step / fused requests/s: " + "; ".join(
        f"{variant}: " + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in one["step_over_fused"].items())
        for variant, one in r["variants"].items()), argv)


if __name__ == "__main__":
    raise SystemExit(main())
