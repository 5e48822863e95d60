"""The offline limit and a per-phase profile: the same pipeline called in-process, no server.

`OfflineLimit` times the plain diffusers call `pipe(prompt=[...], ...)` with a
batch list and the engine's own `ModelRunner` running the same batch as one
request-mode wave (`run_to_completion`: the served loop without the engine's
threads or Triton); the faster of the two is the throughput a server could
reach at that batch size if serving cost nothing.

`phase_profile` times one request's phases (prompt encode, one denoise step,
scheduler step, VAE decode) solo and in a batch, per request, one denoise step
at every batch size up to it, and the top operators of one denoise step from
torch.profiler: where the time goes, and how much of it batching amortises on
this device.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Sequence

from benchmarks.workloads import PROMPTS


def load_adapter(model_path: Path, device: str = "cpu", dtype: str = "auto"):
    """The engine's own loader, so the offline numbers run exactly the served code."""
    from engine_lib.config import EngineConfig
    from engine_lib.pipelines.registry import load_adapter as _load

    return _load(EngineConfig(model_path=str(model_path), device=device, dtype=dtype, warmup=False))


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - start)
    return out


class OfflineLimit:
    """Timed in-process calls of `pipe(prompt=[b prompts])` and of the runner over the same batch.

    `sample()` takes one timed call per path and batch size, so a benchmark can
    interleave it with the served measurements and both see the same machine load.
    """

    PATHS = ("pipe", "runner")

    def __init__(self, adapter, size: int, steps: int, batch_sizes: Sequence[int]):
        self.adapter = adapter
        self.size, self.steps = size, steps
        self.batch_sizes = sorted(set(batch_sizes))
        self.seconds: dict[tuple[int, str], list[float]] = {(b, p): [] for b in self.batch_sizes for p in self.PATHS}

    def _call(self, batch: int, path: str) -> None:
        import torch

        from engine_lib.request import DiffusionRequest
        from engine_lib.runner import ModelRunner

        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
        if path == "pipe":
            generators = [torch.Generator(device=self.adapter.device).manual_seed(i) for i in range(batch)]
            with torch.inference_mode():
                self.adapter.pipe(prompt=prompts, height=self.size, width=self.size,
                                  num_inference_steps=self.steps, generator=generators, output_type="np")
        else:
            requests = [DiffusionRequest(f"offline-{i}", request_params(self.adapter, p, self.size, self.steps, i))
                        for i, p in enumerate(prompts)]
            errors = ModelRunner(self.adapter).run_to_completion(requests).errors
            assert not errors, errors

    def warm(self) -> None:
        """One untimed call per path and batch size (first-call and first-shape effects)."""
        for b in self.batch_sizes:
            for path in self.PATHS:
                self._call(b, path)

    def sample(self) -> None:
        for b in self.batch_sizes:
            for path in self.PATHS:
                self.seconds[(b, path)] += _timed(lambda: self._call(b, path), 1)

    def summary(self) -> dict:
        """Per batch size: each path's seconds, median and images/s, and the best of the two."""
        out = {}
        for b in self.batch_sizes:
            row = {}
            for path in self.PATHS:
                times = self.seconds[(b, path)]
                median = statistics.median(times) if times else None
                row[path] = {"seconds": times, "median_s": median, "images_per_s": b / median if median else None}
            rates = [row[p]["images_per_s"] for p in self.PATHS if row[p]["images_per_s"]]
            row["best_images_per_s"] = max(rates) if rates else None
            out[str(b)] = row
        return out


def request_params(adapter, prompt: str, size: int, steps: int, seed: int):
    """Validated params for one benchmark request (the adapter's own defaults for everything else)."""
    from engine_lib.config import EngineConfig

    schema = adapter.input_schema(EngineConfig())
    return schema.parse({"prompt": prompt, "height": size, "width": size, "num_inference_steps": steps, "seed": seed})


def phase_profile(adapter, size: int, steps: int, batch: int, repeats: int = 3,
                  top_ops: int = 6) -> dict:
    """Seconds per request of each phase, solo (batch 1) and batched (`batch`), plus top step operators.

    The batch uses different prompts (as real traffic does: prompt embeddings are padded and masked);
    `denoise_step_same_prompt_s` times the same batch with one prompt for every row, to show what
    the padding and mask cost.
    """
    import torch

    from engine_lib.pipelines.base import InputBatch

    def new_state(request_id: str, prompt: str, seed: int):
        return adapter.new_state(request_id, request_params(adapter, prompt, size, steps, seed))

    out: dict = {"size": size, "steps": steps, "batch": batch}
    for n in (1, batch):
        states = [new_state(f"prof-{i}", PROMPTS[i % len(PROMPTS)], i) for i in range(n)]
        start = time.perf_counter()
        for state in states:
            adapter.prepare_encode(state)
        encode = time.perf_counter() - start
        input_batch = InputBatch.gather(states)
        adapter.denoise_step(input_batch, states=states)  # warm-up (and fills the text cache)
        step = statistics.median(_timed(lambda: adapter.denoise_step(input_batch, states=states), repeats))
        pred = adapter.denoise_step(input_batch, states=states)
        start = time.perf_counter()
        for state, rows in zip(states, input_batch.split(pred)):
            adapter.step_scheduler(state, rows)
        sched = time.perf_counter() - start
        decode = statistics.median(_timed(lambda: adapter.post_decode(states), repeats))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            adapter.denoise_step(input_batch, states=states)
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total_us = sum(e.self_cpu_time_total for e in events) or 1.0
        out[f"batch_{n}"] = {
            "encode_s_per_request": encode / n,
            "denoise_step_s": step,
            "denoise_step_s_per_request": step / n,
            "scheduler_step_s_per_request": sched / n,
            "decode_s_per_request": decode / n,
            "request_s_per_request": (encode + steps * (step + sched) + decode) / n,
            "top_ops": [{"op": e.key, "share": e.self_cpu_time_total / total_us} for e in events[:top_ops]],
        }
    # The same batch with one prompt for every row: no text padding, no attention mask.
    out[f"batch_{batch}"]["denoise_step_same_prompt_s"] = step_seconds(
        adapter, [new_state(f"same-{i}", PROMPTS[0], i) for i in range(batch)], repeats)
    out["step_s_by_rows"] = {n: step_seconds(adapter, [new_state(f"rows-{i}", PROMPTS[i % len(PROMPTS)], i)
                                                       for i in range(n)], repeats) for n in range(1, batch + 1)}
    solo, batched = out["batch_1"], out[f"batch_{batch}"]
    out["step_speedup_per_request"] = solo["denoise_step_s_per_request"] / batched["denoise_step_s_per_request"]
    out["request_speedup_per_request"] = solo["request_s_per_request"] / batched["request_s_per_request"]
    return out


def step_seconds(adapter, states, repeats: int) -> float:
    """The median seconds of one denoise step over `states` (their prompts encoded, one warm-up step first)."""
    from engine_lib.pipelines.base import InputBatch

    for state in states:
        adapter.prepare_encode(state)
    input_batch = InputBatch.gather(states)
    adapter.denoise_step(input_batch, states=states)
    return statistics.median(_timed(lambda: adapter.denoise_step(input_batch, states=states), repeats))
