"""Host synchronisations per engine tick on CUDA (run by benchmarks/gpu.sh; needs a GPU).

Drives the engine's ModelRunner over the Qwen-Image preset (and every other
pipeline on its tiny preset) on CUDA with
`torch.cuda.set_sync_debug_mode("warn")`, which warns at every call that makes
the host wait for the device, and counts the warnings of each tick by what the
tick did: admitted requests (prompt encode, noise, timesteps), only denoised
(the steady state of continuous batching: the goal is none), or finished
requests (decode, outputs to the host: the goal is the one wait that ends it,
engine_lib/host_copy.py). Writes benchmarks/results/gpu_sync.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_sync.json"  # (not written for --device cpu)


# Every other pipeline on its tiny preset, at a size it serves (the waits do not depend on the weights' size).
OTHERS = {"flux": {"height": 64, "width": 64}, "sd3": {"height": 64, "width": 64},
          "ltx2": {"height": 32, "width": 32, "num_frames": 17}, "bagel": {"height": 32, "width": 32},
          "hunyuan_image3": {"height": 64, "width": 64}, "helios": {"height": 32, "width": 32, "num_frames": 33}}


def count_waits(adapter, inputs: dict, steps: int, cuda: bool) -> dict:
    """Run 12 requests through the runner (one admitted every third tick, at most 4 running) and count the
    host synchronisations of each tick by what it did."""
    import torch

    from engine_lib.config import EngineConfig
    from engine_lib.request import DiffusionRequest
    from engine_lib.runner import ModelRunner

    runner = ModelRunner(adapter)
    schema = adapter.input_schema(EngineConfig(max_height=4096, max_width=4096))

    def request(i: int) -> DiffusionRequest:
        params = schema.parse({"prompt": f"prompt {i % 3}", "num_inference_steps": steps, "seed": i, **inputs})
        return DiffusionRequest(f"r{i}", params)

    counts: dict[str, list[int]] = {"admitting": [], "denoising only": [], "finishing": []}
    first_messages: dict[str, list[str]] = {}
    pending = [request(i) for i in range(12)]
    running: list[DiffusionRequest] = []
    runner.run_to_completion([request(100)])  # warm: kernels, allocator, the pinned-memory pool
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
    try:
        tick = 0
        while pending or running:
            new = [pending.pop(0)] if pending and tick % 3 == 0 and len(running) < min(4, adapter.max_step_batch) else []
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = runner.execute_step(new, running)
            assert not result.output.errors, result.output.errors
            syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
            kind = "finishing" if result.output.finished else "admitting" if new else "denoising only"
            counts[kind].append(len(syncs))
            if syncs:
                first_messages.setdefault(kind, syncs[:5])
            running = [r for r in running + new if r.request_id not in result.output.finished]
            for r in running:
                r.step_index = result.output.step_index.get(r.request_id, r.step_index)
            tick += 1
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    return {kind: {"ticks": len(v), "syncs_mean": statistics.mean(v) if v else None, "syncs_max": max(v, default=None),
                   "first_messages": first_messages.get(kind, [])} for kind, v in counts.items()}


def main() -> int:
    import torch

    from engine_lib.config import EngineConfig
    from engine_lib.pipelines.registry import load_adapter
    from engine_lib.tiny_models import ensure_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="bench", help="Qwen-Image's preset (the others run their tiny one)")
    parser.add_argument("--size", type=int, default=512, help="Qwen-Image's size")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--pipelines", default="qwen_image," + ",".join(OTHERS),
                        help="comma-separated (default: every pipeline)")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only tries the script (no waits to count)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("gpu_sync: torch sees no CUDA device")
    dtype = "bfloat16" if cuda else "float32"
    results = {}
    for name in args.pipelines.split(","):
        qwen = name == "qwen_image"
        model_path = ensure_model(name, args.preset if qwen else "tiny")
        adapter = load_adapter(EngineConfig(pipeline=name, model_path=str(model_path), device=args.device, dtype=dtype,
                                            warmup=False))
        inputs = {"height": args.size, "width": args.size} if qwen else OTHERS[name]
        results[name] = summary = count_waits(adapter, inputs, args.steps, cuda)
        for kind, s in summary.items():
            print(f"[gpu_sync] {name} {kind}: {s['ticks']} ticks, host synchronisations per tick mean "
                  f"{s['syncs_mean']} max {s['syncs_max']}")
        del adapter
    out = RESULTS if cuda else Path("/tmp/gpu_sync_cpu.json")
    out.write_text(json.dumps({"qwen_image_preset": args.preset, "qwen_image_size": args.size, "steps": args.steps,
                               "torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu",
                               "pipelines": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
