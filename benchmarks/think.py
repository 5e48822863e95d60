"""The `think` scenario: BAGEL requests that think before their image mixed with plain ones, in-process.

Every system is the same engine (`DiffusionEngine`, its scheduler and runner, the config the system's parameters
give) on one loaded adapter, fed the same requests by `concurrency` closed-loop client threads; a system's
`adapter` settings are set on the adapter for its run (the baseline's `max_text_rows=1`: at most one request
decodes a token per tick, the others in their text phase wait, seated, while the denoising ones go on).
The work is counted, not only timed: `BagelPipeline.next_tokens` calls (text forwards) and their rows, and
`BagelModel.velocity` calls (denoise forwards) and their rows (a CFG request puts two). Each request's text and
image are compared with the first system's: the same texts, and images within a level (float rounding differs
with a forward's row count on the CPU).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np

from benchmarks.workloads import PROMPTS


def requests(n: int, size: int, steps: int, max_new_tokens: int, seed: int = 0) -> list[dict]:
    """n BAGEL requests, every other one thinking first (at most `max_new_tokens` tokens of thought)."""
    return [{"prompt": PROMPTS[i % len(PROMPTS)], "height": size, "width": size, "num_inference_steps": steps,
             "seed": seed * 1000 + i, "think": i % 2 == 0, "max_new_tokens": max_new_tokens} for i in range(n)]


@contextmanager
def counted(pipe) -> Iterator[Counter]:
    """Counts text and denoise forwards and their rows while the block runs (the pipe's methods wrapped)."""
    counts: Counter = Counter()
    next_tokens, velocity = pipe.next_tokens, pipe.model.velocity

    def text_forward(decodes, *args, **kwargs):
        counts["text_forwards"] += 1
        counts["text_rows"] += len(decodes)
        return next_tokens(decodes, *args, **kwargs)

    def denoise_forward(rows, *args, **kwargs):
        counts["denoise_forwards"] += 1
        counts["denoise_rows"] += len(rows.counts)
        return velocity(rows, *args, **kwargs)

    pipe.next_tokens, pipe.model.velocity = text_forward, denoise_forward
    try:
        yield counts
    finally:
        del pipe.next_tokens, pipe.model.velocity


def closed_loop(engine, specs: Sequence[dict], concurrency: int, tag: str) -> list[dict]:
    """Each of `concurrency` threads sends its next request when its last one ends; every request's latency,
    whether it thought, its text and image."""
    todo, lock, records = iter(enumerate(specs)), threading.Lock(), []

    def client() -> None:
        while True:
            with lock:
                item = next(todo, None)
            if item is None:
                return
            i, spec = item
            start = time.perf_counter()
            final = engine.add_request(f"{tag}-{i}", spec).result(timeout=600)
            latency = time.perf_counter() - start
            if final.error is not None:
                raise RuntimeError(f"{tag}-{i}: {final.error}")
            text = final.outputs["text"][0] if "text" in final.outputs else None
            with lock:
                records.append({"index": i, "think": spec["think"], "latency_s": latency, "text": text,
                                "image": final.outputs["image"][0]})

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if len(records) != len(specs):
        raise RuntimeError(f"{tag}: {len(specs) - len(records)} requests failed")
    return sorted(records, key=lambda r: r["index"])


def run_system(adapter, config, settings: dict, specs: Sequence[dict], concurrency: int, tag: str) -> dict:
    """One system's pass over `specs`: its engine started (and warmed up), the counted work and the latencies."""
    from engine_lib.engine import DiffusionEngine

    saved = {name: getattr(adapter, name) for name in settings}
    for name, value in settings.items():
        setattr(adapter, name, value)
    engine = DiffusionEngine.make_engine(config, adapter=adapter)
    try:
        with counted(adapter.pipe) as counts:
            start = time.perf_counter()
            records = closed_loop(engine, specs, concurrency, tag)
            wall = time.perf_counter() - start
    finally:
        engine.close()
        for name, value in saved.items():
            setattr(adapter, name, value)
    latency = {kind: statistics.median(r["latency_s"] for r in records if r["think"] == think)
               for kind, think in (("think", True), ("plain", False)) if any(r["think"] == think for r in records)}
    return {**counts, "wall_s": wall, "requests_per_s": len(records) / wall,
            "latency_p50_s": latency, "outputs": [(r["text"], r["image"]) for r in records]}


def run(systems: Sequence, specs_of_round, concurrency: int, repeats: int, model_path) -> dict:
    """`repeats` rounds, each every system once (in alternating order) on the round's requests
    (`specs_of_round(r)`), on one adapter loaded as the first system's config says: per system its rounds, and
    whether every system gave the first one's outputs."""
    from engine_lib.config import EngineConfig
    from engine_lib.pipelines.registry import load_adapter

    configs = {s.name: EngineConfig.from_parameters({"pipeline": s.pipeline, **s.parameters,
                                                     "model_path": str(model_path)}) for s in systems}
    adapter = load_adapter(configs[systems[0].name])
    rounds = []
    for r in range(repeats):
        specs = specs_of_round(r)
        points = {}
        for system in systems[::-1] if r % 2 else systems:
            points[system.name] = run_system(adapter, configs[system.name], dict(system.adapter), specs,
                                             concurrency, f"{system.name}{r}")
        first = points[systems[0].name].pop("outputs")
        for p in points.values():
            outputs = p.pop("outputs", first)
            p["texts_equal"] = all(text == text_1 for (text, _), (text_1, _) in zip(outputs, first))
            p["image_max_level"] = max(int(np.abs(image.astype(np.int16) - image_1.astype(np.int16)).max())
                                       for (_, image), (_, image_1) in zip(outputs, first))
        rounds.append({"systems": points})
    return {"rounds": rounds}


def totals(rounds: Sequence[dict], name: str) -> dict:
    """A system's counts summed over rounds, its rows per forward, and its median rate."""
    points = [r["systems"][name] for r in rounds]
    total = {k: sum(p.get(k, 0) for p in points) for k in ("text_forwards", "text_rows", "denoise_forwards",
                                                            "denoise_rows")}
    total["text_rows_per_forward"] = total["text_rows"] / total["text_forwards"] if total["text_forwards"] else None
    total["denoise_rows_per_forward"] = (total["denoise_rows"] / total["denoise_forwards"]
                                         if total["denoise_forwards"] else None)
    total["requests_per_s"] = statistics.median(p["requests_per_s"] for p in points)
    return total
