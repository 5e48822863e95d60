"""`make bench-lora`: LoRA per request, mixed batching vs LoRA-homogeneous batching, side by side in one run.

Workload: requests cycling through no LoRA, toy_a and toy_b (the tiny LoRAs `make models`
writes) on the tiny Qwen-Image, closed loop at concurrency 8, in step mode on two
servers: `lora_batching=mixed` (any LoRAs share one denoise forward, each row gets its
own delta) and `lora_batching=homogeneous` (the LoRA is part of the step key, so each
forward holds one LoRA), the latter with and without head bypass (`max_head_bypass`
16 and 0, the seed's FIFO). Rounds are interleaved between the three servers. Results go to
benchmarks/results/lora.json; docs/benchmarks.md shows them (`make bench`
or `python -m benchmarks.report` re-renders it).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

from benchmarks import systems, workloads
from benchmarks.run import QUICK, interleaved_points, machine_info, side_main

NAMES = ("", "toy_a", "toy_b")


def lora_systems(max_num_seqs: int) -> list[systems.System]:
    engine = dict(device="cpu", dtype="float32", warmup="true", step_execution="true", max_num_seqs=str(max_num_seqs))
    variants = [("mixed", "mixed", "16"), ("homogeneous", "homogeneous", "16"), ("homogeneous_fifo", "homogeneous", "0")]
    return [systems.System(f"lora_{name}", f"STEP_BATCH x{max_num_seqs}, lora_batching={mode}, max_head_bypass={bypass}",
                           systems.MODEL_REPOSITORY, "qwen_image",
                           parameters={**engine, "lora_batching": mode, "max_head_bypass": bypass})
            for name, mode, bypass in variants]


def run(concurrency: int = 8, size: int = 64, steps: int = 8, rounds: int = 12, repeats: int = 3,
        log_dir: Optional[Path] = None) -> dict:
    from engine_lib.tiny_models import ensure_loras, ensure_model

    model_path = ensure_model("qwen_image", "tiny")
    ensure_loras("qwen_image", model_path)
    results = {"kind": "lora", "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(),
               "workload": {"concurrency": concurrency, "size": size, "steps": steps, "loras": ["none", *NAMES[1:]],
                            "requests_per_point": rounds * concurrency, "repeats": repeats}}
    plan = replace(QUICK, size=size, steps=steps, max_num_seqs=concurrency, preview_interval=0)
    results["systems"] = interleaved_points(
        lora_systems(concurrency), model_path, plan, concurrency, repeats,
        lambda r: workloads.mixed_loras(rounds * concurrency, size, steps, NAMES, seed=300 + r), "lora", log_dir)
    rates = {name.removeprefix("lora_"): entry["requests_per_s_median"] for name, entry in results["systems"].items()}
    results["mixed_over_homogeneous"] = rates["mixed"] / rates["homogeneous"] if rates["homogeneous"] else None
    results["mixed_over_homogeneous_fifo"] = (rates["mixed"] / rates["homogeneous_fifo"]
                                              if rates["homogeneous_fifo"] else None)
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    return side_main(__doc__, "lora", run, lambda r: f"mixed / homogeneous: {r['mixed_over_homogeneous']:.2f}x, / "
                     f"homogeneous FIFO: {r['mixed_over_homogeneous_fifo']:.2f}x", argv)


if __name__ == "__main__":
    raise SystemExit(main())
