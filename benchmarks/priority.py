"""`make bench-priority`: an urgent request's latency alone and under a full background load, side by side.

Workload (tiny Qwen-Image, 64x64, 8 steps, step mode, max_num_seqs 4): a closed-loop background of
`background` clients (priority 3, so the queue never empties) while one foreground client sends
`urgent` requests one after another. Variants, each measured on the same servers in one run:

- alone: the foreground requests on an idle server;
- preempt: foreground priority 1, `max_preemptions=1` (an urgent request pauses a background one);
- order: foreground priority 1, `max_preemptions=0` (admitted first, but waits for a free slot);
- separate: foreground priority 1, `priority_batching=separate` (it pauses every background request
  and runs alone);
- fifo: foreground priority 3, like the background (arrival order: the seed's behaviour).

Results go to benchmarks/results/priority.json; docs/benchmarks.md shows them.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

from benchmarks import loadgen, systems, workloads
from benchmarks.run import log, machine_info, side_main


def priority_systems(max_num_seqs: int, device: str = "cpu", dtype: str = "float32") -> list[systems.System]:
    engine = dict(device=device, dtype=dtype, warmup="true", step_execution="true", max_num_seqs=str(max_num_seqs))
    variants = (("preempt", {"max_preemptions": "1"}), ("order", {"max_preemptions": "0"}),
                ("separate", {"max_preemptions": "1", "priority_batching": "separate"}))
    return [systems.System(f"priority_{name}", f"STEP_BATCH x{max_num_seqs}, " + ", ".join(
        f"{k}={v}" for k, v in extra.items()), systems.MODEL_REPOSITORY, "qwen_image", parameters={**engine, **extra})
            for name, extra in variants]


def foreground(target: loadgen.Target, specs: list, gap_s: float, tag: str) -> list[float]:
    """Send specs one at a time (a pause between them); their latencies in seconds."""
    session = target.open()
    latencies = []
    try:
        for i, spec in enumerate(specs):
            record = loadgen.RequestRecord(f"{tag}-{i}", spec)
            record.scheduled = time.perf_counter()
            session.run(record)
            if not record.ok:
                raise RuntimeError(f"{record.request_id}: {record.check_error()}")
            latencies.append(record.latency)
            time.sleep(gap_s)
    finally:
        session.close()
    return latencies


@contextlib.contextmanager
def background_load(target: loadgen.Target, spec, clients: int, tag: str):
    """`clients` closed-loop clients sending `spec` until the block ends; yields their records."""
    stop, records, lock = threading.Event(), [], threading.Lock()

    def client(n: int) -> None:
        session = target.open()
        try:
            for i in range(10**9):
                if stop.is_set():
                    return
                record = loadgen.RequestRecord(f"{tag}-{n}-{i}", replace(spec, seed=n * 1000 + i))
                record.scheduled = time.perf_counter()
                session.run(record)
                with lock:
                    records.append(record)
        finally:
            session.close()

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(clients)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # the queue fills before the first foreground request
    try:
        yield records
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)


def summary(latencies: list[float]) -> dict:
    return {"n": len(latencies), "p50_s": statistics.median(latencies),
            "p99_s": loadgen.percentile(latencies, 99), "max_s": max(latencies)}


def run(background: int = 8, urgent: int = 60, size: int = 64, steps: int = 8, max_num_seqs: int = 4,
        gap_s: float = 0.2, log_dir: Optional[Path] = None) -> dict:
    from engine_lib.tiny_models import ensure_model

    model_path = ensure_model("qwen_image", "tiny")
    base = workloads.uniform(1, size, steps, seed=7)[0]
    fg = [replace(spec, priority=1) for spec in workloads.uniform(urgent, size, steps, seed=8)]
    results = {"kind": "priority", "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(),
               "workload": {"background_clients": background, "urgent_requests": urgent, "size": size,
                            "steps": steps, "max_num_seqs": max_num_seqs, "gap_s": gap_s},
               "variants": {}}
    with contextlib.ExitStack() as stack:
        running = {s.name: stack.enter_context(systems.serve(s, model_path, log_dir=log_dir))
                   for s in priority_systems(max_num_seqs)}
        preempt, order, apart = (running[f"priority_{n}"].target for n in ("preempt", "order", "separate"))
        for target in (preempt, order, apart):  # first-request and batch-shape effects, not measured
            foreground(target, fg[:2], 0.0, "warm")
        plan = [("alone", preempt, fg, False), ("preempt", preempt, fg, True), ("order", order, fg, True),
                ("separate", apart, fg, True), ("fifo", preempt, [replace(s, priority=3) for s in fg], True)]
        for name, target, specs, loaded in plan:
            with contextlib.ExitStack() as load:
                bg = load.enter_context(background_load(target, replace(base, priority=3), background, name)) \
                    if loaded else []
                latencies = foreground(target, specs, gap_s, f"fg-{name}")
            entry = summary(latencies)
            entry["background_completed"] = sum(1 for r in bg if r.ok)
            results["variants"][name] = entry
            log(f"{name}: urgent p50 {entry['p50_s'] * 1000:.0f} ms, p99 {entry['p99_s'] * 1000:.0f} ms, "
                f"background done {entry['background_completed']}")
    alone = results["variants"]["alone"]
    for entry in results["variants"].values():
        entry["p99_over_alone_p99"] = entry["p99_s"] / alone["p99_s"]
        entry["p50_over_alone_p50"] = entry["p50_s"] / alone["p50_s"]
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    return side_main(__doc__, "priority", run, lambda r: "urgent p99 / alone p99: " + ", ".join(
        f"{name} {entry['p99_over_alone_p99']:.2f}x" for name, entry in r["variants"].items()), argv,
        option=("urgent", 60))


if __name__ == "__main__":
    raise SystemExit(main())
