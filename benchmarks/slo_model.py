"""`python -m benchmarks.slo_model`: how much of the Poisson mixed-steps load any admission policy could
bring within its SLO on a machine where batching does not make a step cheaper.

The model: one server runs one denoise step at a time and may switch requests between steps; a step
is never shared (as if a batched step of n rows cost n solo steps), so it bounds what ordering alone can
do. Sharing steps can do more where a shared step costs less than the steps apart (`make bench`'s phase
profile measures a step at each batch size), and `admission_order=deadline` shares them where that pays.
A request costs `fixed + steps * per_step` seconds, half of `fixed` (encode) in its first step and half
(decode) in its last; `per_step` and `fixed` are fitted to the solo latencies
`make bench` measured (benchmarks/results/full.json). Its deadline is arrival + SLO factor x its solo
latency, as the benchmark counts it. The model replays the benchmark's own sequence (the workload's
and the arrivals' seeds) and random sequences of the same length and load, under each policy:

* arrival: first come, first served (each request runs to its end);
* srpt: the fewest seconds of work left first, switching between steps;
* edf: the earliest deadline first;
* srpt_hopeless_last, edf_hopeless_last: the same among requests that can still make their deadline
  if they run alone from now; the others only when none can (they are late anyway);
* moore_hodgson: earliest deadline first over the largest set of requests that can all still make
  their deadlines (the Moore-Hodgson rule), recomputed between steps; the rest when that set is empty;
* edf_shared_if_pays_x2 (when the run's phase profile timed a step at each batch size): the engine's
  `admission_order=deadline` with `max_num_seqs` 2, which shares a step where that pays, at the
  profile's cost of a shared step (`shared_attainment`).

`most_on_time` bounds all but the last within the model: the most requests of the benchmark's sequence that any
schedule could finish on time, even one preempting at any instant (earliest-deadline-first decides whether
a set can all make it). The served engine can do better than the model (part of a solo latency is gRPC
and client time, and a shared step costs less than the steps apart): read the bound as where ordering
alone stops helping. It measures nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

RESULTS = Path(__file__).resolve().parent / "results" / "full.json"


@dataclass
class Job:
    arrival: float
    steps: int
    deadline: float
    steps_left: int = 0
    done: Optional[float] = None

    def __post_init__(self):
        self.steps_left = self.steps


class Costs:
    """Seconds per step and fixed seconds per request, from solo latencies {steps: seconds}."""

    def __init__(self, solo_by_steps: dict[int, float]):
        xs, ys = list(solo_by_steps), list(solo_by_steps.values())
        self.per_step, self.fixed = statistics.linear_regression(xs, ys)
        self.solo = solo_by_steps

    def work_left(self, job: Job) -> float:
        started = job.steps_left < job.steps
        return job.steps_left * self.per_step + self.fixed * (0.5 if started else 1.0)


def moore_hodgson(jobs: list[Job], now: float, costs: Costs) -> list[Job]:
    """The largest set of `jobs` that all make their deadlines in deadline order (drop the longest on a miss)."""
    kept, clock = [], now
    for job in sorted(jobs, key=lambda j: j.deadline):
        kept.append(job)
        clock += costs.work_left(job)
        if clock > job.deadline:
            longest = max(kept, key=costs.work_left)
            kept.remove(longest)
            clock -= costs.work_left(longest)
    return kept


def pick(policy: str, active: list[Job], now: float, costs: Costs, running: Optional[Job]) -> Job:
    if policy == "arrival":
        return running if running in active else min(active, key=lambda j: j.arrival)
    if policy == "moore_hodgson":
        kept = moore_hodgson(active, now, costs)
        return min(kept, key=lambda j: j.deadline) if kept else min(active, key=costs.work_left)
    order: Callable[[Job], float] = costs.work_left if policy.startswith("srpt") else (lambda j: j.deadline)
    if policy.endswith("_hopeless_last"):
        feasible = [j for j in active if now + costs.work_left(j) <= j.deadline]
        if feasible:
            return min(feasible, key=order)
        return min(active, key=costs.work_left)
    return min(active, key=order)


def edf_feasible(jobs: Sequence[tuple[float, float, float]]) -> bool:
    """Whether jobs (release, work, deadline) all finish by their deadlines when any job may be preempted at
    any instant: earliest-deadline-first is optimal there, so it decides."""
    pending = sorted(jobs)
    ready: list[list[float]] = []  # [deadline, work left]
    now, i = 0.0, 0
    while i < len(pending) or ready:
        if not ready:
            now = max(now, pending[i][0])
        while i < len(pending) and pending[i][0] <= now:
            ready.append([pending[i][2], pending[i][1]])
            i += 1
        ready.sort()
        until = pending[i][0] if i < len(pending) else float("inf")
        job = ready[0]
        run_for = min(job[1], until - now)
        now += run_for
        job[1] -= run_for
        if job[1] <= 1e-12:
            if now > job[0] + 1e-9:
                return False
            ready.pop(0)
    return True


def most_on_time(arrivals: Sequence[tuple[float, int]], costs: Costs, slo_factor: float, max_late: int = 4) -> Optional[int]:
    """The most requests any schedule could finish by their deadlines, even preempting at any instant (an upper
    bound for every policy above): n - k for the fewest k late requests that leave the rest feasible, trying
    every set of k up to `max_late`; None if more must be late."""
    from itertools import combinations

    jobs = [(t, costs.fixed + s * costs.per_step, t + slo_factor * costs.solo[s]) for t, s in arrivals]
    for late in range(max_late + 1):
        for dropped in combinations(range(len(jobs)), late):
            if edf_feasible([j for i, j in enumerate(jobs) if i not in dropped]):
                return len(jobs) - late
    return None


POLICIES = ("arrival", "srpt", "edf", "srpt_hopeless_last", "edf_hopeless_last", "moore_hodgson")


def replay(arrivals: Sequence[tuple[float, int]], costs: Costs, slo_factor: float,
           choose: Callable[[list[Job], float], list[Job]], step_ratio: Optional[dict[int, float]] = None) -> float:
    """The share of requests done by their deadline when, between steps, `choose(active, now)` picks the
    requests of the next step: a step of that many rows (`step_ratio[rows]` solo steps; default one solo
    step per row) plus the fixed parts of the requests it starts or ends."""
    jobs = [Job(t, s, t + slo_factor * costs.solo[s]) for t, s in sorted(arrivals)]
    now, arrived, active = 0.0, 0, []
    while arrived < len(jobs) or active:
        while arrived < len(jobs) and jobs[arrived].arrival <= now:
            active.append(jobs[arrived])
            arrived += 1
        if not active:
            now = jobs[arrived].arrival
            continue
        batch = choose(active, now)
        now += costs.per_step * (step_ratio or {}).get(len(batch), len(batch)) + sum(
            costs.fixed * 0.5 * ((j.steps_left == j.steps) + (j.steps_left == 1)) for j in batch)
        for job in batch:
            job.steps_left -= 1
            if job.steps_left == 0:
                job.done = now
                active.remove(job)
    return sum(j.done <= j.deadline for j in jobs) / len(jobs)


def attainment(policy: str, arrivals: Sequence[tuple[float, int]], costs: Costs, slo_factor: float) -> float:
    """The share of requests done by their deadline when `policy` schedules `arrivals` [(time, steps)], one
    request a step."""
    last: list[Optional[Job]] = [None]  # the arrival policy keeps running what it ran

    def choose(active: list[Job], now: float) -> list[Job]:
        last[0] = pick(policy, active, now, costs, last[0])
        return [last[0]]

    return replay(arrivals, costs, slo_factor, choose)


def shared_attainment(arrivals: Sequence[tuple[float, int]], costs: Costs, slo_factor: float,
                      step_ratio: dict[int, float], max_rows: int = 2) -> float:
    """The share on time under the engine's `admission_order=deadline` with shared steps: earliest deadline
    first among requests that can still make theirs alone (the others after), and one more joins a step
    only while a step of k rows (`step_ratio[k]` solo steps) costs at most 95 % of the steps apart and every
    member that can make its deadline alone still makes it with all its steps left shared
    (StepScheduler._batching_pays; the model decides each step afresh, where the engine admits once)."""
    def seconds(rows: int) -> float:
        return costs.per_step * step_ratio.get(rows, float(rows))

    def finish(job: Job, rows: int, now: float) -> float:
        return now + job.steps_left * seconds(rows) + costs.fixed * (0.5 if job.steps_left < job.steps else 1.0)

    def choose(active: list[Job], now: float) -> list[Job]:
        feasible = sorted((j for j in active if finish(j, 1, now) <= j.deadline), key=lambda j: j.deadline)
        queue = feasible + sorted((j for j in active if j not in feasible), key=costs.work_left)
        batch = queue[:1]
        for job in queue[1:max_rows]:
            rows = len(batch) + 1
            if seconds(rows) > 0.95 * (seconds(rows - 1) + seconds(1)) or any(
                    finish(j, rows, now) > j.deadline for j in batch + [job] if j in feasible):
                break
            batch.append(job)
        return batch

    return replay(arrivals, costs, slo_factor, choose, step_ratio)


def random_sequence(rng: random.Random, n: int, rate: float, step_choices: Sequence[int]) -> list[tuple[float, int]]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append((t, rng.choice(list(step_choices))))
    return out


def benchmark_case(specs: Sequence, rate: float, solo: dict) -> tuple[list[tuple[float, int]], Costs]:
    """The Poisson point's arrival sequence [(time, steps)] for `specs` at `rate` (its seed), and the costs
    fitted to the solo latencies of their shapes."""
    from benchmarks import loadgen
    from benchmarks.run import POISSON_ARRIVAL_SEED

    sequence = list(zip(loadgen.poisson_arrivals(len(specs), rate, seed=POISSON_ARRIVAL_SEED),
                        (s.steps for s in specs)))
    shapes = {s.steps: s.shape_key for s in specs}
    return sequence, Costs({steps: solo[shapes[steps]] for steps in sorted(shapes)})


def round_bounds(points: Sequence[dict], specs: Sequence, slo_factor: float) -> dict:
    """`most_on_time` of the benchmark's sequence at each Poisson round's own calibration (a round's points keep
    its rate as offered_rate and its solo latencies): {"requests", "on_time": [one per round, None if below
    the search's reach]}."""
    return {"requests": len(specs),
            "on_time": [most_on_time(*benchmark_case(specs, p["offered_rate"], p["solo_latency_s"]), slo_factor)
                        for p in points]}


def step_ratio(results: dict) -> dict[int, float]:
    """{rows: a step of that many rows in solo steps} from the run's phase profile ({} if it has none)."""
    by_rows = {int(n): t for n, t in results.get("offline", {}).get("profile", {}).get("step_s_by_rows", {}).items()}
    return {n: t / by_rows[1] for n, t in sorted(by_rows.items())} if by_rows.get(1) else {}


def run(results_path: Path = RESULTS, sequences: int = 300) -> dict:
    from benchmarks.run import poisson_rate, poisson_specs

    results = json.loads(results_path.read_text())
    plan, solo = results["plan"], results["solo_latency_s"]
    specs = poisson_specs(plan["poisson_requests"], plan["size"], plan["mixed_step_choices"], plan["preview_interval"])
    rate = poisson_rate(solo, specs, plan["poisson_load"])
    bench_sequence, costs = benchmark_case(specs, rate, solo)
    rng = random.Random(0)
    randoms = [random_sequence(rng, len(specs), rate, plan["mixed_step_choices"]) for _ in range(sequences)]
    out = {"source": str(results_path.name), "started": results["started"], "rate": rate,
           "per_step_s": costs.per_step, "fixed_s": costs.fixed, "slo_factor": plan["slo_factor"],
           "sequences": sequences, "policies": {}}
    policies: dict[str, Callable[[list], float]] = {
        policy: (lambda seq, policy=policy: attainment(policy, seq, costs, plan["slo_factor"])) for policy in POLICIES}
    ratio = step_ratio(results)
    if ratio:  # the engine's deadline order, sharing steps where the phase profile says it pays
        rows = int(results["systems"].get("step_deadline", {}).get("parameters", {}).get("max_num_seqs", 2))
        policies[f"edf_shared_if_pays_x{rows}"] = lambda seq: shared_attainment(seq, costs, plan["slo_factor"], ratio, rows)
        out["step_ratio"] = ratio
    for policy, share_of in policies.items():
        shares = [share_of(seq) for seq in randoms]
        out["policies"][policy] = {"benchmark_sequence": share_of(bench_sequence),
                                   "random_mean": statistics.mean(shares),
                                   "random_p10": sorted(shares)[len(shares) // 10],
                                   "random_share_at_least_95": sum(s >= 0.95 for s in shares) / len(shares)}
    best = most_on_time(bench_sequence, costs, plan["slo_factor"])
    out["most_on_time"] = {"requests": len(specs), "on_time": best}
    if results.get("poisson_model"):
        out["rounds"] = results["poisson_model"]["on_time"]
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--sequences", type=int, default=300)
    args = parser.parse_args(argv)
    out = run(args.results, args.sequences)
    print(f"Poisson mixed steps at {out['rate']:.3f}/s ({out['source']}, {out['started']}): "
          f"{out['per_step_s'] * 1000:.1f} ms per step + {out['fixed_s'] * 1000:.1f} ms per request; SLO "
          f"{out['slo_factor']}x solo")
    if out.get("step_ratio"):
        print("A step of n rows in solo steps (the run's phase profile): "
              + ", ".join(f"{n}: {r:.2f}x" for n, r in out["step_ratio"].items()))
    print(f"| policy | the benchmark's sequence | {out['sequences']} random sequences: mean | p10 | share >= 95 % |")
    print("|---|---|---|---|---|")
    for policy, p in out["policies"].items():
        print(f"| {policy} | {p['benchmark_sequence']:.0%} | {p['random_mean']:.1%} | {p['random_p10']:.0%} | "
              f"{p['random_share_at_least_95']:.0%} |")
    best, n = out["most_on_time"]["on_time"], out["most_on_time"]["requests"]
    print("Any schedule of the benchmark's sequence, even preempting at any instant: at most "
          + (f"{best} of {n} on time ({best / n:.1%})" if best is not None else f"fewer than {n - 4} of {n} on time"))
    if out.get("rounds"):
        print("At each Poisson round's own calibration (as the run recorded): at most "
              + ", ".join("-" if b is None else str(b) for b in out["rounds"]) + f" of {n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
