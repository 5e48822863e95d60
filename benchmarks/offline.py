"""The offline limit and a per-phase profile: the same pipeline called in-process, no server.

`OfflineLimit` times the plain diffusers call `pipe(prompt=[...])` and the engine's own tick over the same
batch (the served loop without threads or Triton); the faster is what a server could reach at that batch size if
serving cost nothing. `phase_profile` times one request's phases solo and batched: where the time goes, and how
much of it batching amortises. `run_wave` and `closed_loop` are the other in-process scenarios' drivers."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Sequence

from benchmarks.loadgen import share
from benchmarks.workloads import PROMPTS


def load_adapter(model_path: Path, device: str = "cpu", dtype: str = "auto"):
    """The engine's own loader, so the offline numbers run exactly the served code."""
    from engine_lib.config import EngineConfig
    from engine_lib.pipelines.registry import load_adapter as _load

    return _load(EngineConfig.of(model_path=str(model_path), device=device, dtype=dtype, warmup=False))


def sync() -> None:
    """Wait for the GPU's queued work, so that a timing ends when the work does."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> list[float]:
    """The seconds of each of `repeats` calls of `fn`."""
    out = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - start)
    return out


class OfflineLimit:
    """Timed in-process calls of `pipe(prompt=[b prompts])` and of the runner over the same batch.

    `sample()` takes one timed call per path and batch size, so a benchmark can
    interleave it with the served measurements and both see the same machine load.
    """

    PATHS = ("pipe", "runner")

    def __init__(self, adapter, size: int, steps: int, batch_sizes: Sequence[int]):
        self.adapter, self.size, self.steps = adapter, size, steps
        self.batch_sizes = sorted(set(batch_sizes))
        self.seconds: dict[tuple[int, str], list[float]] = {(b, p): [] for b in self.batch_sizes for p in self.PATHS}

    def _call(self, batch: int, path: str) -> None:
        import torch

        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
        if path == "pipe":
            generators = [torch.Generator(device=self.adapter.device).manual_seed(i) for i in range(batch)]
            with torch.inference_mode():
                self.adapter.pipe(prompt=prompts, height=self.size, width=self.size,
                                  num_inference_steps=self.steps, generator=generators, output_type="np")
        else:
            run_wave(self.adapter, [{"prompt": p, "height": self.size, "width": self.size,
                                     "num_inference_steps": self.steps, "seed": i} for i, p in enumerate(prompts)])

    def warm(self) -> None:
        """One untimed call per path and batch size (first-call and first-shape effects)."""
        for b, path in self.seconds:
            self._call(b, path)

    def sample(self) -> None:
        for b, path in self.seconds:
            self.seconds[(b, path)] += timed(lambda: self._call(b, path), 1)

    def summary(self) -> dict:
        """Per batch size: each path's seconds, median and images/s, and the best of the two."""
        out = {}
        for b in self.batch_sizes:
            row = {}
            for path in self.PATHS:
                times = self.seconds[(b, path)]
                median = statistics.median(times) if times else None
                row[path] = {"seconds": times, "median_s": median, "images_per_s": b / median if median else None}
            row["best_images_per_s"] = max(filter(None, (row[p]["images_per_s"] for p in self.PATHS)), default=None)
            out[str(b)] = row
        return out


def parse(adapter, values: dict):
    """`values` validated as the adapter's inputs (its defaults for the rest), as the engine validates a request's."""
    from engine_lib.config import EngineConfig

    return adapter.input_schema(EngineConfig()).parse(values)


def run_wave(adapter, wave: Sequence[dict]) -> list[dict]:
    """One request-mode wave of the engine's own tick, without its thread or Triton: each request's outputs."""
    from engine_lib.config import EngineConfig
    from engine_lib.engine import DiffusionEngine

    finals = DiffusionEngine.wave(adapter, EngineConfig(), len(wave)).generate(
        {f"wave-{i}": parse(adapter, values) for i, values in enumerate(wave)})
    failed = [final.error for final in finals.values() if not final.ok]
    if failed:
        raise RuntimeError(failed[0])
    return [finals[f"wave-{i}"].outputs for i in range(len(wave))]


def phase_profile(adapter, size: int, steps: int, batch: int, repeats: int = 3) -> dict:
    """Seconds per request of each phase, solo (batch 1) and batched (`batch`), and of one step by rows.

    The batch uses different prompts (as real traffic does: prompt embeddings are padded and masked);
    `denoise_step_same_prompt_s` times the same batch with one prompt for every row, to show what
    the padding and mask cost.
    """
    from engine_lib.pipelines.base import InputBatch

    def new_state(request_id: str, prompt: str, seed: int):
        return adapter.new_state(request_id, parse(adapter, {"prompt": prompt, "height": size, "width": size,
                                                             "num_inference_steps": steps, "seed": seed}))

    out: dict = {"size": size, "steps": steps, "batch": batch}
    for n in (1, batch):
        states = [new_state(f"prof-{i}", PROMPTS[i % len(PROMPTS)], i) for i in range(n)]
        encode = timed(lambda: [adapter.prepare_encode(state) for state in states], 1)[0]
        input_batch = InputBatch.gather(states)
        adapter.denoise_step(input_batch, states=states)  # warm-up (and fills the text cache)
        step = statistics.median(timed(lambda: adapter.denoise_step(input_batch, states=states), repeats))
        pred = adapter.denoise_step(input_batch, states=states)
        sched = timed(lambda: [adapter.step_scheduler(s, r) for s, r in zip(states, input_batch.split(pred))], 1)[0]
        decode = statistics.median(timed(lambda: adapter.post_decode(states), repeats))
        out[f"batch_{n}"] = {"encode_s_per_request": encode / n, "denoise_step_s": step,
                             "denoise_step_s_per_request": step / n, "scheduler_step_s_per_request": sched / n,
                             "decode_s_per_request": decode / n,
                             "request_s_per_request": (encode + steps * (step + sched) + decode) / n}
    # The same batch with one prompt for every row: no text padding, no attention mask.
    out[f"batch_{batch}"]["denoise_step_same_prompt_s"] = step_seconds(
        adapter, [new_state(f"same-{i}", PROMPTS[0], i) for i in range(batch)], repeats)
    out["step_s_by_rows"] = {n: step_seconds(adapter, [new_state(f"rows-{i}", PROMPTS[i % len(PROMPTS)], i)
                                                       for i in range(n)], repeats) for n in range(1, batch + 1)}
    return out


def step_seconds(adapter, states, repeats: int) -> float:
    """The median seconds of one denoise step over `states` (their prompts encoded, one warm-up step first)."""
    from engine_lib.pipelines.base import InputBatch

    for state in states:
        adapter.prepare_encode(state)
    input_batch = InputBatch.gather(states)
    adapter.denoise_step(input_batch, states=states)
    return statistics.median(timed(lambda: adapter.denoise_step(input_batch, states=states), repeats))


def closed_loop(engine, specs: Sequence[dict], concurrency: int, tag: str, timeout_s: float = 600) -> list[dict]:
    """Each of `concurrency` threads sends its next request to the in-process engine when its last one ends: every
    request's latency, whether it thought, its text and image, in order."""
    records = []

    def send(item: tuple[int, dict]) -> None:
        i, spec = item
        start = time.perf_counter()
        final = engine.add_request(f"{tag}-{i}", spec).result(timeout=timeout_s)
        if final.error is not None:
            raise RuntimeError(f"{tag}-{i}: {final.error}")
        records.append({"index": i, "think": spec.get("think", False), "latency_s": time.perf_counter() - start,
                        "text": final.outputs["text"][0] if "text" in final.outputs else None,
                        "image": final.outputs["image"][0]})

    share(enumerate(specs), [send] * concurrency)
    return sorted(records, key=lambda r: r["index"])
