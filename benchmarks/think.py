"""The `think` scenario: BAGEL requests that think before their image mixed with plain ones, in-process.

Every system is the same engine on one loaded adapter (its `adapter` settings set for its run), fed the same
requests by closed-loop client threads. The work is counted, not only timed (`counted`), and each request's text
and image are compared with the first system's; docs/benchmarks.md (`think`)."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np

from benchmarks.offline import closed_loop
from benchmarks.workloads import PROMPTS

KINDS = ("text", "denoise")  # the forwards counted


def requests(n: int, size: int, steps: int, max_new_tokens: int, seed: int = 0) -> list[dict]:
    """n BAGEL requests, every other one thinking first (at most `max_new_tokens` tokens of thought)."""
    return [{"prompt": PROMPTS[i % len(PROMPTS)], "height": size, "width": size, "num_inference_steps": steps,
             "seed": seed * 1000 + i, "think": i % 2 == 0, "max_new_tokens": max_new_tokens} for i in range(n)]


@contextmanager
def counted(pipe) -> Iterator[Counter]:
    """Counts text and denoise forwards and their rows while the block runs (the pipe's methods wrapped)."""
    counts: Counter = Counter()

    def counting(kind: str, forward, rows_of):
        def wrapped(rows, *args, **kwargs):
            counts[f"{kind}_forwards"] += 1
            counts[f"{kind}_rows"] += rows_of(rows)
            return forward(rows, *args, **kwargs)
        return wrapped

    pipe.next_tokens = counting("text", pipe.next_tokens, len)
    pipe.model.velocity = counting("denoise", pipe.model.velocity, lambda rows: len(rows.counts))
    try:
        yield counts
    finally:
        del pipe.next_tokens, pipe.model.velocity


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
        specs, points = specs_of_round(r), {}
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
    total = {f"{kind}_{k}": sum(p.get(f"{kind}_{k}", 0) for p in points) for kind in KINDS
             for k in ("forwards", "rows")}
    for kind in KINDS:
        forwards = total[f"{kind}_forwards"]
        total[f"{kind}_rows_per_forward"] = total[f"{kind}_rows"] / forwards if forwards else None
    total["requests_per_s"] = statistics.median(p["requests_per_s"] for p in points)
    return total
