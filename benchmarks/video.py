"""`make bench-video`: LTX-2 serial vs fused vs step batching (frames/s), Helios time to first chunk vs final.

LTX-2 workload: the tiny preset, 64x64, 17 frames (3 latent frames), step counts
drawn from (4, 8), every guidance pass at the pipeline's defaults (CFG, STG,
modality: four rows per request in three forwards), closed loop at concurrency 4
on three servers: request mode one at a time (`max_num_seqs=1`), request mode
fused (`max_num_seqs=4`, 20 ms admission wait: equal step counts share a wave),
and step mode (`max_num_seqs=4`: requests join between steps). Helios: the tiny
preset, 64x64, 97 frames (three chunks of 33), 4 steps per chunk, one request at a
time (the seed's limit); the first response is the first chunk. Rounds are
interleaved. Results go to benchmarks/results/video.json; docs/benchmarks.md shows them.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

from benchmarks import systems, workloads
from benchmarks.run import QUICK, interleaved_points, machine_info, side_main

LTX2_FRAMES, HELIOS_FRAMES = 17, 97


def ltx2_systems(concurrency: int) -> list[systems.System]:
    engine = dict(device="cpu", dtype="float32", warmup="true")
    modes = (("serial", "LTX-2: REQUEST_BATCH serial (max_num_seqs=1)", "false", 1, 0),
             ("fused", f"LTX-2: REQUEST_BATCH fused x{concurrency} (20 ms wait)", "false", concurrency, 20),
             ("step", f"LTX-2: STEP_BATCH continuous x{concurrency}", "true", concurrency, 0))
    return [systems.System(f"ltx2_{name}", label, systems.MODEL_REPOSITORY, "ltx2",
                           parameters={**engine, "step_execution": step, "max_num_seqs": str(seqs),
                                       "request_batch_max_wait_ms": str(wait)})
            for name, label, step, seqs, wait in modes]


def helios_system() -> systems.System:
    return systems.System("helios", "Helios: one request at a time, streamed by chunk", systems.MODEL_REPOSITORY,
                          "helios", parameters=dict(device="cpu", dtype="float32", warmup="true",
                                                    step_execution="true", max_num_seqs="1"))


def run(concurrency: int = 4, size: int = 64, rounds: int = 6, repeats: int = 3,
        log_dir: Optional[Path] = None) -> dict:
    from engine_lib.tiny_models import ensure_model

    results = {"kind": "video", "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(),
               "workload": {"concurrency": concurrency, "size": size, "ltx2_frames": LTX2_FRAMES,
                            "ltx2_steps": [4, 8], "helios_frames": HELIOS_FRAMES, "helios_steps": 4,
                            "requests_per_point": rounds * concurrency, "repeats": repeats}}
    plan = replace(QUICK, size=size, steps=4, max_num_seqs=concurrency, preview_interval=0)

    def ltx2_specs(r: int) -> list:
        specs = workloads.mixed_steps(rounds * concurrency, size, (4, 8), seed=500 + r)
        return [replace(spec, num_frames=LTX2_FRAMES) for spec in specs]

    ltx2 = interleaved_points(ltx2_systems(concurrency), ensure_model("ltx2", "tiny"), plan, concurrency, repeats,
                              ltx2_specs, "ltx2", log_dir)
    for entry in ltx2.values():
        entry["frames_per_s_median"] = entry["requests_per_s_median"] * LTX2_FRAMES
    serial = ltx2["ltx2_serial"]["frames_per_s_median"]
    results["ltx2"] = ltx2
    results["ltx2_over_serial"] = {name.removeprefix("ltx2_"): (e["frames_per_s_median"] / serial if serial else None)
                                   for name, e in ltx2.items()}

    def helios_specs(r: int) -> list:
        return [replace(spec, num_frames=HELIOS_FRAMES) for spec in workloads.uniform(rounds, size, 4, seed=600 + r)]

    helios = interleaved_points([helios_system()], ensure_model("helios", "tiny"), replace(plan, max_num_seqs=1), 1,
                                repeats, helios_specs, "helios", log_dir)["helios"]
    firsts = [p["first_preview_p50_s"] for p in helios["points"]]
    finals = [p["latency_p50_s"] for p in helios["points"]]
    helios["first_chunk_p50_s"], helios["final_p50_s"] = firsts, finals
    results["helios"] = helios
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    return side_main(__doc__, "video", run, lambda r: "LTX-2 frames/s over serial: " + ", ".join(
        f"{name} {ratio:.2f}x" for name, ratio in r["ltx2_over_serial"].items()), argv)


if __name__ == "__main__":
    raise SystemExit(main())
