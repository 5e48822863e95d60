"""One model over several GPUs against the same model on one (`bash benchmarks/gpu.sh` runs it with more than one).

For each parallel configuration (docs/deployment.md, One model over several devices) the engine runs the same
requests in this process (no Triton) on one GPU, then on the configuration's ranks: the seconds of one request
alone and of `--requests` at once, and the largest uint8 difference of their images. A configuration a pipeline
does not support, or one this host has too few GPUs for, is reported as skipped with the reason.

    python -m benchmarks.parallel --device cuda --dtype bfloat16 --preset gpu --out benchmarks/results/gpu
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from benchmarks.offline import closed_loop
from benchmarks.report import table

CFG = {"negative_prompt": "blurry, low quality", "true_cfg_scale": 4.0}


def configs(gpus: int) -> list[tuple[str, dict, dict]]:
    """(pipeline, parallel parameters, extra request inputs): what fits each model (docs/deployment.md)."""
    tp = max(n for n in (2, 4, 8) if n <= max(gpus, 2))
    return [("qwen_image", {"cfg_parallel": True}, CFG),
            ("qwen_image", {"sequence_parallel_size": 2}, {}),
            ("flux", {"sequence_parallel_size": 2}, {}),
            ("hunyuan_image3", {"tensor_parallel_size": tp, "expert_parallel": True}, {}),
            ("hunyuan_image3", {"tensor_parallel_size": tp}, {}),
            # everything at once on 4 GPUs: two CFG groups of two Ulysses ranks, a LoRA and the step cache
            ("qwen_image", {"cfg_parallel": True, "sequence_parallel_size": 2},
             {**CFG, "lora_name": "toy_a", "lora_scale": 0.7, "cache": "first_block"})]


def run(engine, inputs: list[dict]) -> tuple[float, list[np.ndarray]]:
    """Every request at once: the seconds until the last final, and each image."""
    start = time.perf_counter()
    records = closed_loop(engine, inputs, len(inputs), "r", timeout_s=3600)
    return time.perf_counter() - start, [record["image"] for record in records]


def measure(model_path: str, device: str, dtype: str, parameters: dict, inputs: list[dict]) -> dict:
    from engine_lib.config import EngineConfig
    from engine_lib.engine import DiffusionEngine

    engine = DiffusionEngine.make_engine(EngineConfig.of(model_path=model_path, device=device, dtype=dtype,
                                                         max_num_seqs=len(inputs), **parameters))
    try:
        solo, _ = run(engine, inputs[:1])
        together, images = run(engine, inputs)
    finally:
        engine.close()
    return {"solo_s": solo, "together_s": together, "images": images}


def main() -> None:
    import torch

    from engine_lib.config import ConfigError, EngineConfig
    from engine_lib.pipelines.tiny_models import available, ensure_loras, ensure_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--preset", default="gpu", help="the random-weight preset, where the pipeline has it")
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results/gpu")
    parser.add_argument("--only", default="", help="the configurations whose name holds this (e.g. cfg_parallel)")
    args = parser.parse_args()
    on_cuda = args.device.startswith("cuda")
    gpus = torch.cuda.device_count() if on_cuda else 2  # (on the CPU: a check of this script, two gloo ranks)
    rows = []
    for pipeline, parameters, extra in configs(gpus):
        name = f"{pipeline} " + " ".join(f"{k}={v}" for k, v in parameters.items())
        if args.only not in name:
            continue
        preset = args.preset if args.preset in available()[pipeline] else "tiny"
        world = EngineConfig.of(pipeline=pipeline, **parameters).parallel.world_size
        row = {"config": name, "preset": preset, "ranks": world}
        rows.append(row)
        if world > gpus:
            row["skipped"] = f"{world} ranks, {gpus} devices"
            continue
        path = str(ensure_model(pipeline, preset))
        loras = Path(f"{path}-loras")  # the toy LoRAs of this preset (their shapes follow its transformer)
        base = {"lora_dir": str(ensure_loras(pipeline, Path(path), loras))} if "lora_name" in extra else {}
        inputs = [{"prompt": f"a photo of object {i}", "seed": i, "num_inference_steps": args.steps, **extra}
                  for i in range(args.requests)]
        try:
            one = measure(path, "cuda:0" if on_cuda else args.device, args.dtype, base, inputs)
            ranks = measure(path, args.device, args.dtype, {**base, **parameters}, inputs)
        except (ConfigError, NotImplementedError) as error:
            row["skipped"] = str(error)
            continue
        levels = max(int(np.abs(a.astype(int) - b.astype(int)).max()) for a, b in zip(one["images"], ranks["images"]))
        row.update({"one_gpu_solo_s": one["solo_s"], "ranks_solo_s": ranks["solo_s"],
                    "one_gpu_together_s": one["together_s"], "ranks_together_s": ranks["together_s"],
                    "max_uint8_difference": levels})
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "parallel.json").write_text(json.dumps(rows, indent=1) + "\n")
    keys = ("one_gpu_solo_s", "ranks_solo_s", "one_gpu_together_s", "ranks_together_s")
    text = table([[row["config"], row["preset"], str(row["ranks"])] + (
        [f"skipped: {row['skipped']}", "", "", "", ""] if "skipped" in row else
        [f"{row[k]:.2f}" for k in keys] + [str(row["max_uint8_difference"])]) for row in rows],
        ["config", "preset", "ranks", "1 GPU solo s", "ranks solo s", "1 GPU together s", "ranks together s",
         "max uint8 diff"])
    (out / "parallel.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
