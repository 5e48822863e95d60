"""Results JSON -> docs/benchmarks.md (tables, targets) and docs/img/*.png (matplotlib, Agg).

`python -m benchmarks.report [results.json]` regenerates the page from the
newest full result (benchmarks/results/full.json), else the quick one. Every
number on the page comes from the JSON; nothing is typed in by hand.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.perf_analyzer import EXPLANATION as PERF_ANALYZER_NOTE

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
DOC_PATH = REPO_ROOT / "docs" / "benchmarks.md"
STEP, SERIAL, NAIVE, SRPT, DEADLINE = "step", "rb_serial", "naive", "step_srpt", "step_deadline"
FUSED_WAIT, STEP_MIXED = "rb_fused_wait", "step_mixed"
# One colour per system in every plot.
COLORS = {"rb_serial": "tab:blue", "rb_fused": "tab:orange", "rb_fused_wait": "tab:green", "step": "tab:red",
          "naive": "tab:purple", "step_srpt": "tab:brown", "step_deadline": "tab:pink"}


# ---------------------------------------------------------------------------
# Reading results


def newest_results() -> Path:
    for name in ("full.json", "quick.json"):
        if (RESULTS_DIR / name).is_file():
            return RESULTS_DIR / name
    raise FileNotFoundError(f"no results in {RESULTS_DIR}: run `make bench` or `make bench-quick`")


def spread(values: Sequence[Optional[float]]) -> Optional[tuple[float, float, float]]:
    """(median, min, max) of the non-missing values, or None."""
    vals = [v for v in values if v is not None]
    return (statistics.median(vals), min(vals), max(vals)) if vals else None


def closed_stat(system: dict, concurrency: int, key: str = "requests_per_s") -> Optional[tuple[float, float, float]]:
    return spread([p.get(key) for p in system.get("closed", {}).get(str(concurrency), [])])


def rounds(system: dict, field: str) -> list[dict]:
    """The rounds of a side load (`poisson`, `mixed_sizes`); results from before rounds hold one point."""
    return system.get(f"{field}_points") or ([system[field]] if system.get(field) else [])


def round_ratios(a: dict, b: dict, field: str, key: str) -> list[Optional[float]]:
    """a's `key` over b's, round by round (a round runs both, one after the other)."""
    return [ratio(x.get(key), y.get(key)) for x, y in zip(rounds(a, field), rounds(b, field))]


def top_concurrency(results: dict) -> int:
    cs = results["plan"]["concurrencies"]
    return 8 if 8 in cs else max(cs)


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def offline_best(results: dict) -> Optional[float]:
    limit = results.get("offline", {}).get("limit", {})
    batch = str(results["plan"]["max_num_seqs"])
    return limit.get(batch, {}).get("best_images_per_s")


# ---------------------------------------------------------------------------
# Targets


def target(name: str, value, goal: float, higher_is_better: bool, unit: str = "x") -> dict:
    """One target row. `value`: one number, or the rounds' numbers (the median is compared; min-max kept as
    `span`)."""
    values = value if isinstance(value, list) else [value]
    stat = spread(values)
    value = stat[0] if stat else None
    met = None if value is None else (value >= goal if higher_is_better else value <= goal)
    return {"target": name, "value": value, "goal": goal, "met": met, "unit": unit, "higher_is_better": higher_is_better,
            "span": stat[1:] if stat and sum(v is not None for v in values) > 1 else None}


def targets(results: dict) -> list[dict]:
    """The targets of the issues (the first's four, #13's SLO and mixed sizes), each with its measured value
    and whether it is met."""
    S = results["systems"]
    c = top_concurrency(results)

    def rps(name: str, key: str = "requests_per_s") -> Optional[float]:
        stat = closed_stat(S[name], c, key) if name in S else None
        return stat[0] if stat else None

    out = []

    def add(*args, **kwargs) -> None:
        out.append(target(*args, **kwargs))

    add(f"STEP_BATCH / REQUEST_BATCH serial, requests/s at concurrency {c}", ratio(rps(STEP), rps(SERIAL)), 2.5, True)
    add(f"STEP_BATCH served images/s at concurrency {c} / offline limit (batch {results['plan']['max_num_seqs']})",
        ratio(rps(STEP, "images_per_s"), offline_best(results)), 0.9, True)
    step, serial = S.get(STEP, {}), S.get(SERIAL, {})
    add("Poisson mixed steps: STEP_BATCH p99 / REQUEST_BATCH serial p99",
        round_ratios(step, serial, "poisson", "latency_p99_s"), 0.5, False)
    add("Poisson mixed steps: STEP_BATCH SLO attainment (3x solo latency)",
        [p.get("slo_attainment") for p in rounds(step, "poisson")], 0.95, True, unit="%")
    for name in (SRPT, DEADLINE):
        if S.get(name, {}).get("poisson"):
            add(f"Poisson mixed steps: {S[name]['label']} SLO attainment",
                [p.get("slo_attainment") for p in rounds(S[name], "poisson")], 0.95, True, unit="%")
    add(f"STEP_BATCH / naive baseline, requests/s at concurrency {c}", ratio(rps(STEP), rps(NAIVE)), 2.5, True)
    for name in (STEP, STEP_MIXED):
        if S.get(name, {}).get("mixed_sizes") and S.get(FUSED_WAIT, {}).get("mixed_sizes"):  # issue #13
            add(f"Mixed sizes {results['plan']['mixed_sizes']}: {S[name]['label']} / {S[FUSED_WAIT]['label']}, "
                f"requests/s at concurrency {max(results['plan']['concurrencies'])}",
                round_ratios(S[name], S[FUSED_WAIT], "mixed_sizes", "requests_per_s"), 1.3, True)
    return out


def fmt_target_value(t: dict) -> str:
    if t["value"] is None:
        return "not measured"

    def one(v: float) -> str:
        return f"{v:.0%}" if t["unit"] == "%" else f"{v:.2f}x"

    return one(t["value"]) + (f" ({one(t['span'][0])}-{one(t['span'][1])})" if t.get("span") else "")


def fmt_goal(t: dict) -> str:
    op = ">=" if t["higher_is_better"] else "<="
    return f"{op} {t['goal']:.0%}" if t["unit"] == "%" else f"{op} {t['goal']:g}x"


def target_rows(rows: list[dict]) -> list[str]:
    """The rows of a "| target | measured | goal | result |" table."""
    return [f"| {t['target']} | {fmt_target_value(t)} | {fmt_goal(t)} | {fmt_met(t)} |" for t in rows]


def targets_line(rows: list[dict]) -> str:
    """Targets on one line (a benchmark's closing log line)."""
    return "; ".join(f"{t['target']}: {fmt_target_value(t)} ({fmt_met(t)})" for t in rows)


def fmt_met(t: dict) -> str:
    if t["met"] is None:
        return "n/a"
    if t["met"]:
        return "met"
    if t["higher_is_better"]:
        return f"missed ({t['value'] / t['goal']:.0%} of the goal)"
    return f"missed ({t['value'] / t['goal']:.1f}x the allowed value)"


def limits_text(results: dict) -> list[str]:
    """Why a missed throughput target is missed, from the in-process profile of this run."""
    prof = results.get("offline", {}).get("profile")
    if not prof:
        return []
    b = prof["batch"]
    solo, batched = prof["batch_1"], prof[f"batch_{b}"]
    lines = [
        f"Batching {b} requests makes one denoise step {prof['step_speedup_per_request']:.2f}x cheaper per request "
        f"on this device ({solo['denoise_step_s']:.3f} s solo vs {batched['denoise_step_s']:.3f} s for {b} rows), "
        f"and a whole request {prof['request_speedup_per_request']:.2f}x cheaper. That is the ceiling of any "
        f"batching gain over serial here: continuous batching cannot beat the device's own batching efficiency.",
    ]
    by_rows = {int(n): seconds for n, seconds in prof.get("step_s_by_rows", {}).items()}
    if by_rows.get(1):
        lines.append("One denoise step of n rows costs, in steps of one row: " + ", ".join(
            f"{n}: {seconds / by_rows[1]:.2f}x" for n, seconds in sorted(by_rows.items()) if n > 1)
            + " (different prompts; the median of a few calls each).")
    best = offline_best(results)
    limit = results.get("offline", {}).get("limit", {})
    solo_best = limit.get("1", {}).get("best_images_per_s")
    if best and solo_best:
        ceiling = best / solo_best
        line = (f"Offline (no server) the pipeline does {solo_best:.2f} images/s at batch 1 and {best:.2f} at batch "
                f"{results['plan']['max_num_seqs']}: {ceiling:.2f}x, the most any batching server can gain over "
                "serial on this device.")
        achieved = next((t["value"] for t in targets(results) if t["target"].startswith("STEP_BATCH / REQUEST_BATCH")),
                        None)
        if achieved:
            line += f" STEP_BATCH reached {achieved:.2f}x over serial, {achieved / ceiling:.0%} of that ceiling."
        lines.append(line)
    return lines


# ---------------------------------------------------------------------------
# Plots


def plot_throughput(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, system in results["systems"].items():
        cs = sorted(int(c) for c in system.get("closed", {}))
        stats = [closed_stat(system, c) for c in cs]
        pts = [(c, s) for c, s in zip(cs, stats) if s]
        if not pts:
            continue
        xs = [c for c, _ in pts]
        med = [s[0] for _, s in pts]
        err = [[s[0] - s[1] for _, s in pts], [s[2] - s[0] for _, s in pts]]
        ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=system["label"], color=COLORS.get(name))
    best = offline_best(results)
    if best:
        ax.axhline(best, color="grey", linestyle="--",
                   label=f"offline limit, batch {results['plan']['max_num_seqs']} (images/s)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(results["plan"]["concurrencies"])
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("concurrency (closed loop)")
    ax.set_ylabel("requests/s")
    plan = results["plan"]
    ax.set_title(f"Throughput vs concurrency: {plan['size']}x{plan['size']}, {plan['steps']} steps, "
                 f"{plan['preset']} preset")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency_cdf(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, system in results["systems"].items():
        lat = sorted(system.get("poisson", {}).get("latencies_s") or [])
        if not lat:
            continue
        ys = [(i + 1) / len(lat) for i in range(len(lat))]
        ax.step(lat, ys, where="post", label=system["label"], color=COLORS.get(name))
    plan = results["plan"]
    rate = results.get("poisson_rate")
    ax.set_xlabel("end-to-end latency (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"Latency CDF, mixed steps {plan['mixed_step_choices']}, Poisson "
                 f"{rate or 0:.2f}/s ({plan['poisson_load']:.0%} of serial capacity)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------
# Markdown


def f(x: Optional[float], digits: int = 2, suffix: str = "") -> str:
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def fmt_spread(stat: Optional[tuple[float, float, float]], digits: int = 2, percent: bool = False) -> str:
    """(median, min, max) as "median (min-max)", or the median alone when they are equal; `percent`:
    fractions as whole percentages."""
    if not stat:
        return "-"

    def one(v: float) -> str:
        return f"{v:.0%}" if percent else f"{v:.{digits}f}"

    med, lo, hi = stat
    return one(med) if lo == hi else f"{one(med)} ({one(lo)}-{one(hi)})"


def render(results: dict, source: Path, img_rel: str = "img", img_prefix: str = "") -> str:
    plan, machine, S = results["plan"], results["machine"], results["systems"]
    c = top_concurrency(results)
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `python -m benchmarks.run{' --quick' if plan['name'] == 'quick' else ''}` "
        f"(`make bench{'-quick' if plan['name'] == 'quick' else ''}`) from "
        f"`{source.relative_to(REPO_ROOT) if source.is_relative_to(REPO_ROOT) else source}`, "
        f"started {results.get('started', '?')}. Do not edit by hand: rerun the benchmark or "
        "`python -m benchmarks.report`.",
        "",
        "## Setup",
        "",
        f"- Machine: {machine['nproc']} CPUs ({machine['cpu_model']}), {machine['ram_gib']} GiB RAM, "
        f"GPU: {machine['gpu'] or 'none'}; Python {machine['python']}, torch {machine['torch']}, "
        f"diffusers {machine['diffusers']}.",
        f"- Load average (1, 5, 15 min) before: {results.get('load_before')}, after: {results.get('load_after')}. "
        "1-minute load when each system started: "
        + ", ".join(f"`{n}` {s['load_at_start'][0]:.1f}" for n, s in S.items() if s.get("load_at_start")) + ". "
        "Other jobs shared this machine; ratios measured side by side in one run are more robust than the "
        "absolute numbers.",
        f"- Model: Qwen-Image `{plan['preset']}` random-weight preset (`engine_lib.tiny_models`), "
        f"{plan.get('dtype', 'float32')} on {plan.get('device', 'cpu')}.",
        f"- Uniform workload: {plan['size']}x{plan['size']}, {plan['steps']} steps, preview every "
        f"{plan['preview_interval']} steps (streaming systems), 1 image per request.",
        f"- Closed loop: concurrency {plan['concurrencies']}, each client sends {plan['rounds']} requests per point "
        f"(at least 2), {plan['repeats']} repeat(s) per point; tables give the median over repeats and the "
        "spread (min-max) in brackets.",
        f"- Mixed steps: steps drawn from {plan['mixed_step_choices']}, {plan['poisson_requests']} requests, "
        f"Poisson arrivals at {plan['poisson_load']:.0%} of REQUEST_BATCH serial capacity "
        f"({rate_text(rounds(S.get(SERIAL, {}), 'poisson'), results.get('poisson_rate'))}). "
        f"Mixed sizes: {plan['mixed_sizes']}, closed loop at "
        f"concurrency {max(plan['concurrencies'])}.",
        f"- SLO: {plan['slo_factor']:g}x the solo latency of the request's size and steps, measured on REQUEST_BATCH "
        f"serial at concurrency 1: {', '.join(f'{k}: {v:.2f} s' for k, v in results.get('solo_latency_s', {}).items())}"
        + (" at the start (the Poisson rounds' own: before each round)." if recalibrated(results) else "."),
        "- Systems, each its own tritonserver on a copy of the model repository, all up for the whole run: "
        + "; ".join(f"`{n}` = {s['label']}" for n, s in S.items()) + ". The closed-loop points are interleaved "
        "(each repeat and concurrency runs on every system back to back, then one offline sample); mixed sizes "
        f"and Poisson loads run in rounds ({plan.get('mixed_sizes_repeats', 1)} and {plan.get('poisson_repeats', 1)}), "
        "each round every system once, one after the other."
        + "".join(f" `{n}` runs only the Poisson load." for n, s in S.items() if not s.get("closed")),
        f"- Each server gets one request alone, then {plan['max_num_seqs']} at concurrency {plan['max_num_seqs']}, "
        "unmeasured, before its first measurement. "
        f"Total wall time of the run: {f((results.get('wall_s') or 0) / 60, 1)} min.",
        *retries_note(S),
        "",
        "## Targets",
        "",
        "| target | measured | goal | result |",
        "|---|---|---|---|",
    ]
    lines += target_rows(targets(results))
    missed = [t for t in targets(results) if t["met"] is False]
    if missed:
        lines += ["", "What limits the missed targets (measured in this run):", ""]
        lines += [f"- {line}" for line in limits_text(results)]
        lines += [f"- {line}" for line in gap_notes(results)]
    lines += [
        "",
        "## Throughput vs concurrency (uniform workload)",
        "",
        f"![throughput vs concurrency]({img_rel}/{img_prefix}throughput.png)",
        "",
        "Requests/s, median (min-max) over repeats:",
        "",
        "| system | " + " | ".join(f"c={cc}" for cc in plan["concurrencies"])
        + f" | mean batch at c={c} | peak RSS (server tree) | start-up |",
        "|---|" + "---|" * len(plan["concurrencies"]) + "---|---|---|",
    ]
    closed = {name: s for name, s in S.items() if s.get("closed")}  # (some systems run only the Poisson load)
    for name, s in closed.items():
        batch = spread([p.get("server", {}).get("mean_batch_size") for p in s.get("closed", {}).get(str(c), [])])
        lines.append(f"| {s['label']} | " + " | ".join(fmt_spread(closed_stat(s, cc), 3) for cc in plan["concurrencies"])
                     + f" | {fmt_spread(batch, 1)} | {f((s.get('peak_rss_bytes') or 0) / 2**20, 0, ' MiB')} "
                     f"| {f(s.get('startup_s'), 0, ' s')} |")
    lines += [
        "",
        f"Latency at concurrency {c} (uniform workload, seconds; medians over repeats):",
        "",
        "| system | mean | p50 | p95 | p99 | first preview p50 | SLO attainment | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in closed.values():
        pts = s.get("closed", {}).get(str(c), [])

        def med(key: str) -> Optional[float]:
            stat = spread([p.get(key) for p in pts])
            return stat[0] if stat else None

        lines.append(f"| {s['label']} | {f(med('latency_mean_s'))} | {f(med('latency_p50_s'))} | "
                     f"{f(med('latency_p95_s'))} | {f(med('latency_p99_s'))} | {f(med('first_preview_p50_s'))} | "
                     f"{f(med('slo_attainment') and med('slo_attainment') * 100, 0, '%')} | "
                     f"{sum(p.get('errors', 0) for p in pts)} |")
    lines += poisson_section(results, f"{img_rel}/{img_prefix}") + mixed_sizes_section(results) + offline_section(results)
    lines += profile_section(results) + perf_analyzer_section(results) + other_pipelines_section(results)
    lines += (lora_section() + size_batching_section() + packing_section() + priority_section() + slo_section() + own_models_section() + video_section() + efficiency_section() + scheduling_section() + gpu_section(results)
              + reproduce_section())
    return "\n".join(lines) + "\n"


def _steps(shape_key: str) -> int:
    """The step count of a workload shape key such as "128x128/16"."""
    return int(shape_key.rsplit("/", 1)[1])


def gap_notes(results: dict) -> list[str]:
    """Measured facts that explain the gap between served and offline, and the serving overhead."""
    S, c = results["systems"], top_concurrency(results)
    notes = []
    step = S.get(STEP, {})
    pts = step.get("closed", {}).get(str(c), [])
    batch = spread([p.get("server", {}).get("mean_batch_size") for p in pts])
    busy = [p["server"]["device_busy_s"] / p["duration_s"] for p in pts
            if p.get("server", {}).get("device_busy_s") and p.get("duration_s")]
    if batch:
        notes.append(f"STEP_BATCH at concurrency {c} formed batches of {batch[0]:.1f} requests per step on average "
                     f"(max_num_seqs {results['plan']['max_num_seqs']}); new requests join between steps, so the "
                     "batch is never full while earlier requests finish and are replaced.")
    poisson = step.get("poisson", {})
    by_shape = poisson.get("slo_by_shape") or {}
    if by_shape and poisson.get("slo_attainment", 1.0) < 0.95:
        worst = min(by_shape, key=lambda k: by_shape[k]["attainment"])
        best = max(by_shape, key=lambda k: by_shape[k]["attainment"])
        prof = results.get("offline", {}).get("profile", {})
        b = prof.get("batch")
        slow = ""
        if b and prof.get("batch_1"):
            slow = (f" (one batched step of {b} takes {prof[f'batch_{b}']['denoise_step_s'] / prof['batch_1']['denoise_step_s']:.1f}x "
                    "a solo step on this CPU)")
        note = (f"Under Poisson arrivals STEP_BATCH met the SLO for {by_shape[best]['attainment']:.0%} of the "
                f"{best} requests but only {by_shape[worst]['attainment']:.0%} of the {worst} ones: a request shares "
                f"every step with whoever else is running, so each of its steps takes the batched step time{slow}"
                + (", and a short request's 3x budget is the smallest." if _steps(worst) == min(map(_steps, by_shape))
                   else "."))
        srpt = S.get(SRPT, {}).get("poisson", {})
        if srpt.get("slo_attainment") is not None:
            note += (f" {S[SRPT]['label']} met it for {srpt['slo_attainment']:.0%}: a short request runs with at "
                     "most one other and may pause the one with the most steps left, so it no longer shares "
                     "every step with long ones; the long ones wait instead.")
        load = poisson.get("load_at_start")
        if load and results.get("load_before") and not recalibrated(results):  # (runs from before per-round rates)
            note += (f" The machine's 1-minute load was {load[0]:.1f} when this run started, against "
                     f"{results['load_before'][0]:.1f} when the solo latencies (the SLO) were calibrated.")
        notes.append(note)
    cpu = [p["cpu_s"] for p in pts if p.get("cpu_s")]
    if cpu:
        total = {k: sum(c[k] for c in cpu) for k in cpu[0]}
        wall = sum(p["duration_s"] for p in pts if p.get("duration_s"))
        used = sum(total.values())
        if used and wall:
            available = results["machine"]["nproc"] * wall
            serving = total["tritonserver"] + total["loadgen"]
            notes.append(
                f"CPU time during STEP_BATCH at concurrency {c} ({results['machine']['nproc']} CPUs x {wall:.1f} s "
                f"wall = {available:.1f} CPU-s): model process {total['model']:.1f} s ({total['model'] / available:.0%}), "
                f"tritonserver {total['tritonserver']:.1f} s and load generator {total['loadgen']:.1f} s "
                f"({serving / available:.1%} together). The rest went to other jobs on this shared machine or idled.")
    if busy:
        share = statistics.median(busy)
        if share >= 0.95:
            notes.append(f"The engine thread was busy (inside ticks) {share:.0%} of the wall time at concurrency {c}: "
                         "the device loop, not the serving path, is the bottleneck. Its ticks also carry the work a "
                         "lock-step offline batch does once: prompt encodes of joining requests, decodes of "
                         "finishing ones in small groups, and previews.")
        else:
            notes.append(f"The engine thread was busy (inside ticks) {share:.0%} of the wall time at concurrency {c}; "
                         "the rest is the serving path (request parsing, responses through Triton's Python-backend "
                         "shared memory, gRPC) and the gaps between a request ending and its client's next one.")
    return notes


def retries_note(systems: dict) -> list[str]:
    """A line naming the systems whose engine retried a failed batch one request at a time during a measured
    point (`diffusion_batch_retries_total`): their batches were not what their numbers assume."""
    retried = {}
    for name, system in systems.items():
        points = [p for ps in system.get("closed", {}).values() for p in ps]
        points += rounds(system, "poisson") + rounds(system, "mixed_sizes")
        retried[name] = sum(p.get("server", {}).get("batch_retries", 0) for p in points)
    named = ", ".join(f"`{n}` {int(k)}" for n, k in retried.items() if k)
    return [f"- Batches that failed and ran again one request at a time (see the servers' logs): {named}."] if named else []


def recalibrated(results: dict) -> bool:
    """Whether the run calibrated each Poisson round's solo latencies and rate just before it (run.poisson_calibration)."""
    return any("solo_latency_s" in p for s in results["systems"].values() for p in rounds(s, "poisson"))


def rate_text(points: list[dict], run_rate: Optional[float]) -> str:
    """A Poisson load's rate: each round's, where each round recalibrated its own (run.poisson_calibration; `points`
    are one system's rounds), else the run's one."""
    rates = [p["offered_rate"] for p in points if "solo_latency_s" in p and p.get("offered_rate")]
    if rates:
        return "recalibrated before each round: " + ", ".join(f"{r:.3f}" for r in rates) + " requests/s"
    return f"{f(run_rate, 3)} requests/s"


def busy_share(point: dict) -> Optional[float]:
    """The share of a point's span its engine spent in ticks; REQUEST_BATCH serial's is the load it was offered."""
    busy = point.get("server", {}).get("device_busy_s")
    return busy / point["duration_s"] if busy is not None and point.get("duration_s") else None


def poisson_section(results: dict, img_base: str) -> list[str]:
    S = results["systems"]
    rows = [(s["label"], s["poisson"], rounds(s, "poisson")) for s in S.values() if s.get("poisson")]
    if not rows:
        return []
    lines = ["", "## Mixed steps under Poisson arrivals", "",
             f"![latency CDF]({img_base}latency_cdf.png)", "",
             "| system | offered/s | achieved/s | mean | p50 | p95 | p99 | first preview p50 | SLO attainment | "
             "mean batch | engine busy | errors | load at start |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, p, runs in rows:
        load = p.get("load_at_start")
        lines.append(f"| {label} | {f(p.get('offered_rate'), 3)} | {f(p.get('requests_per_s'), 3)} | "
                     f"{f(p.get('latency_mean_s'))} | {f(p.get('latency_p50_s'))} | {f(p.get('latency_p95_s'))} | "
                     f"{f(p.get('latency_p99_s'))} | {f(p.get('first_preview_p50_s'))} | "
                     f"{fmt_spread(spread([r.get('slo_attainment') for r in runs]), percent=True)} | "
                     f"{f(p.get('server', {}).get('mean_batch_size'), 1)} | "
                     f"{fmt_spread(spread([busy_share(r) for r in runs]), percent=True)} | {p.get('errors')} | "
                     f"{f(load[0] if load else None, 1)} |")
    n, repeats = results["plan"]["poisson_requests"], max(len(runs) for _, _, runs in rows)
    lines += ["", f"Latencies in seconds, counted from each request's arrival; achieved/s counts until the last "
              f"request ends. With {n} requests the p99 is close to the maximum: read it as the tail, not a "
              "precise percentile. Engine busy: the share of the round's span the engine spent in its ticks, every "
              "round (median, min-max); REQUEST_BATCH serial's is the load the round really offered, "
              f"{results['plan']['poisson_load']:.0%} if the machine kept the speed its calibration saw."]
    if repeats > 1:
        lines[-1] += (f" Each system ran the same arrival sequence in {repeats} rounds (a round runs every system "
                      "once); a row is the system's median round by SLO attainment, with the attainment of every "
                      "round as (min-max). The plot and the table by shape show that round.")
    shapes = [(s["label"], s["poisson"]["slo_by_shape"]) for s in S.values() if s.get("poisson", {}).get("slo_by_shape")]
    if shapes:
        keys = sorted({k for _, by in shapes for k in by}, key=lambda k: int(k.split("/")[1]))
        lines += ["", "SLO attainment by request shape (requests of that shape in brackets):", "",
                  "| system | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        for label, by in shapes:
            lines.append(f"| {label} | " + " | ".join(
                f"{by[k]['attainment']:.0%} ({by[k]['requests']})" if k in by else "-" for k in keys) + " |")
    return lines + ordering_bound_lines(results)


def mixed_sizes_section(results: dict) -> list[str]:
    rows = [(s["label"], s["mixed_sizes"], rounds(s, "mixed_sizes")) for s in results["systems"].values()
            if s.get("mixed_sizes")]
    if not rows:
        return []
    plan = results["plan"]
    lines = ["", f"## Mixed sizes {plan['mixed_sizes']} (closed loop, concurrency {max(plan['concurrencies'])})", "",
             "With the default `mixed_size_batching=false`, requests of different sizes never share a batch (their "
             "shapes are in the compatibility key); with it on (Qwen-Image packs their image tokens), any sizes "
             "share a step. The section \"Mixed image sizes\" below has both presets and the offline limit.", "",
             "| system | requests/s | mean | p99 | SLO attainment | mean batch | errors |", "|---|---|---|---|---|---|---|"]
    for label, p, runs in rows:
        slo = p.get("slo_attainment")
        lines.append(f"| {label} | {fmt_spread(spread([r.get('requests_per_s') for r in runs]), 3)} | "
                     f"{f(p.get('latency_mean_s'))} | "
                     f"{f(p.get('latency_p99_s'))} | {f(None if slo is None else slo * 100, 0, '%')} | "
                     f"{f(p.get('server', {}).get('mean_batch_size'), 1)} | {p.get('errors')} |")
    repeats = max(len(runs) for _, _, runs in rows)
    if repeats > 1:
        lines += ["", f"{repeats} rounds (a round runs every system once): requests/s is the median with (min-max); "
                  "the other columns are the system's median round."]
    return lines


def offline_section(results: dict) -> list[str]:
    limit = results.get("offline", {}).get("limit")
    if not limit:
        return []
    plan = results["plan"]
    lines = ["", "## Offline limit (in-process, no server)", "",
             f"The same pipeline at {plan['size']}x{plan['size']}, {plan['steps']} steps, called directly: "
             "`pipe(prompt=[...])` with a batch list (diffusers) and the engine's `ModelRunner` running the batch "
             "as one wave (the served loop, no threads, no Triton; results before contract v2 timed the "
             "adapter's fused `forward` here): one warm-up call, then the median of one timed call after each "
             "closed-loop repeat.", "",
             "| batch | pipe() images/s | engine runner images/s |", "|---|---|---|"]
    for b, row in sorted(limit.items(), key=lambda kv: int(kv[0])):
        engine = row.get("runner", row.get("adapter_forward", {}))  # results before contract v2 say adapter_forward
        lines.append(f"| {b} | {f(row['pipe']['images_per_s'], 3)} | {f(engine.get('images_per_s'), 3)} |")
    return lines


def profile_section(results: dict) -> list[str]:
    prof = results.get("offline", {}).get("profile")
    if not prof:
        return []
    b = prof["batch"]
    solo, batched = prof["batch_1"], prof[f"batch_{b}"]
    lines = ["", "## Where the time goes (per-phase profile, in-process)", "",
             f"Seconds per request at {prof['size']}x{prof['size']}; one denoise step solo vs {b} requests in one "
             "batched step.", "",
             f"| phase | solo | batch {b}, per request | batching speed-up |", "|---|---|---|---|"]
    for key, label in (("encode_s_per_request", "prompt encode (once)"),
                       ("denoise_step_s_per_request", "one denoise step (transformer)"),
                       ("scheduler_step_s_per_request", "one scheduler step"),
                       ("decode_s_per_request", "VAE decode (once)"),
                       ("request_s_per_request", f"whole request ({prof['steps']} steps)")):
        lines.append(f"| {label} | {solo[key]:.4f} | {batched[key]:.4f} | {ratio(solo[key], batched[key]) or 0:.2f}x |")
    same = batched.get("denoise_step_same_prompt_s")
    if same:
        lines += ["", f"The batch of {b} above has different prompts, so prompt embeddings are padded to the longest "
                  f"and masked: one batched step takes {batched['denoise_step_s']:.3f} s. The same batch with one "
                  f"prompt for every row (no padding, no mask) takes {same:.3f} s "
                  f"({batched['denoise_step_s'] / same:.2f}x)."]
    lines += ["", "Top operators of one denoise step (share of CPU self time):", "",
              f"| solo | batch {b} |", "|---|---|"]
    for a, bb in zip(solo["top_ops"], batched["top_ops"]):
        lines.append(f"| {a['op']} {a['share']:.0%} | {bb['op']} {bb['share']:.0%} |")
    return lines


def perf_analyzer_section(results: dict) -> list[str]:
    pa = results["systems"].get(STEP, {}).get("perf_analyzer")
    if not pa:
        return []
    lines = ["", "## perf_analyzer cross-check (STEP_BATCH server)", "", PERF_ANALYZER_NOTE, ""]
    if pa.get("error"):
        return lines + [f"perf_analyzer failed: `{pa['error'][-300:]}`"]
    summ, exp, cmp = pa.get("summary", {}), pa.get("export", {}), pa.get("comparison", {})
    lines += [f"Command: `{pa.get('command')}`", "",
              f"perf_analyzer printed: \"{summ.get('decoupled_note', '(no decoupled-model note)')}\".", "",
              "| quantity (mean) | seconds |", "|---|---|",
              f"| perf_analyzer 'Avg latency' | {f(summ.get('avg_latency_s'), 3)} |",
              f"| first response, from --profile-export-file | {f(exp.get('first_response_mean_s'), 3)} |",
              f"| end-to-end (last response), from --profile-export-file | {f(exp.get('e2e_mean_s'), 3)} |",
              f"| load generator, same requests and concurrency ({pa.get('concurrency')}), mean of the runs just "
              f"before and after ({', '.join(f'{x:.3f}' for x in pa.get('loadgen_mean_latencies_s', []))}) "
              f"| {f(cmp.get('loadgen_mean_s'), 3)} |",
              ""]
    match = pa.get("avg_latency_matches")
    if match == "last response":
        lines.append("Measured: despite its note, this perf_analyzer's 'Avg latency' equals the mean LAST-response "
                     "(end-to-end) latency of its own export, not the first-response one. Either way, the export "
                     "is the reliable source.")
    elif match == "first response":
        lines.append("Measured: perf_analyzer's 'Avg latency' matches the first-response mean of its export, as "
                     "its note says: it is the time to the first progress message, not to the image.")
    within = cmp.get("within_margin")
    lines += ["", f"perf_analyzer throughput {f(summ.get('throughput_per_s'), 3)} requests/s "
              f"({f(summ.get('response_throughput_per_s'), 3)} responses/s, "
              f"{f(exp.get('responses_per_request'), 1)} responses per request). "
              f"Export-derived end-to-end vs load generator: {f((cmp.get('relative_difference') or 0) * 100, 1)}% "
              f"apart; stated margin {f((cmp.get('margin') or 0) * 100, 0)}%: "
              f"{'within' if within else 'NOT within' if within is False else 'n/a'}."]
    return lines


def side_results(path: Optional[Path], name: str) -> Optional[dict]:
    """A side benchmark's saved results (benchmarks/results/<name>.json unless `path`), or None if never run."""
    path = path or RESULTS_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def system_rows(systems: dict, p99: bool = False) -> list[str]:
    """A side benchmark's table: each system's req/s (and p99 latency), requests per forward, errors."""
    header = "| system | req/s |" + (" p99 latency s |" if p99 else "") + " mean requests per forward | errors |"
    rows = [header, "|" + "---|" * (header.count("|") - 1)]
    for entry in systems.values():
        points = entry["points"]
        cells = [entry["label"], fmt_spread(spread([p["requests_per_s"] for p in points]), 3)]
        if p99:
            cells.append(fmt_spread(spread([p.get("latency_p99_s") for p in points])))
        cells += [fmt_spread(spread([p["server"].get("mean_batch_size") for p in points])),
                  str(sum(p.get("errors", 0) for p in points))]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def lora_section(path: Optional[Path] = None) -> list[str]:
    """Mixed vs LoRA-homogeneous step batching (`make bench-lora`, its own run: benchmarks/results/lora.json)."""
    results = side_results(path, "lora")
    if results is None:
        return []
    w = results["workload"]
    lines = ["", "## LoRA per request: mixed vs homogeneous batches", "",
             f"`make bench-lora`, started {results['started']}: the tiny Qwen-Image, {w['size']}x{w['size']}, "
             f"{w['steps']} steps, requests cycling through {', '.join(w['loras'])}, closed loop at concurrency "
             f"{w['concurrency']}, {w['requests_per_point']} requests per point, {w['repeats']} interleaved repeats "
             "(median, min-max). Every server runs step mode; `lora_batching=homogeneous` puts the LoRA in the step "
             "key (the seed's rule), `mixed` lets any LoRAs share a forward; `max_head_bypass=0` is the seed's FIFO "
             "admission, where a waiting request with another LoRA than the running batch's holds up everyone behind "
             "it.", ""] + system_rows(results["systems"])
    lines += ["", f"Mixed / homogeneous requests/s (medians): {f(results.get('mixed_over_homogeneous'), 2, 'x')} "
              f"with head bypass, {f(results.get('mixed_over_homogeneous_fifo'), 2, 'x')} against FIFO admission. "
              "On this CPU a bigger batch makes a step only a little cheaper per request, so fuller forwards buy "
              "little here; the mean requests per forward shows what each policy achieves."]
    return lines


def own_models_section(path: Optional[Path] = None) -> list[str]:
    """Our own model code, step batching vs serial (`make bench-own`: benchmarks/results/own_models.json)."""
    results = side_results(path, "own_models")
    if results is None:
        return []
    w = results["workload"]
    lines = ["", "## Own model code (BAGEL, HunyuanImage-3.0): step batching vs serial", "",
             f"`make bench-own`, started {results['started']}: each tiny preset (the golden checkpoint of "
             f"tests/golden/<pipeline>), {w['size']}x{w['size']}, {w['steps']} steps, CFG at the model's default "
             f"scale (two rows per request), closed loop at concurrency {w['concurrency']}, "
             f"{w['requests_per_point']} requests per point, {w['repeats']} interleaved repeats (median, min-max).",
             ""] + system_rows(results["systems"], p99=True)
    ratios = ", ".join(f"{name} {f(ratio, 2, 'x')}" for name, ratio in results["step_over_serial"].items())
    lines += ["", f"Step batching / serial requests/s (medians): {ratios}. Tiny random weights: this measures the "
              "engine and batching, not the models' speed."]
    return lines


def video_section(path: Optional[Path] = None) -> list[str]:
    """LTX-2 serial vs fused vs step (frames/s) and Helios first chunk vs final (`make bench-video`)."""
    results = side_results(path, "video")
    if results is None:
        return []
    w = results["workload"]
    lines = ["", "## Video: LTX-2 batching modes, Helios chunk streaming", "",
             f"`make bench-video`, started {results['started']}: tiny presets, {w['size']}x{w['size']}. LTX-2: "
             f"{w['ltx2_frames']} frames, step counts drawn from {w['ltx2_steps']}, the pipeline's default guidance "
             f"(CFG, STG and modality passes), closed loop at concurrency {w['concurrency']}, "
             f"{w['requests_per_point']} requests per point, {w['repeats']} interleaved repeats (median, min-max).",
             "", "| system | frames/s | req/s | p99 latency s | mean requests per forward | errors |",
             "|---|---|---|---|---|---|"]
    for entry in results["ltx2"].values():
        points = entry["points"]
        lines.append(f"| {entry['label']} | {fmt_spread(spread([p['requests_per_s'] * w['ltx2_frames'] for p in points]))}"
                     f" | {fmt_spread(spread([p['requests_per_s'] for p in points]), 3)} | "
                     f"{fmt_spread(spread([p.get('latency_p99_s') for p in points]))} | "
                     f"{fmt_spread(spread([p['server'].get('mean_batch_size') for p in points]))} | "
                     f"{sum(p.get('errors', 0) for p in points)} |")
    ratios = ", ".join(f"{name} {f(ratio, 2, 'x')}" for name, ratio in results["ltx2_over_serial"].items())
    helios = results["helios"]
    lines += ["", f"Frames/s over serial (medians): {ratios}.", "",
              f"Helios, {w['helios_frames']} frames (three chunks), {w['helios_steps']} steps per chunk, one request at "
              f"a time: time to the first chunk {fmt_spread(spread(helios['first_chunk_p50_s']))} s, to the final "
              f"video {fmt_spread(spread(helios['final_p50_s']))} s (p50 per repeat; median, min-max). Tiny random "
              "weights: this measures the engine and batching, not the models' speed."]
    return lines


def efficiency_section(path: Optional[Path] = None) -> list[str]:
    """Served and in-process engine vs the offline batched limit, with the per-phase split (`make bench-efficiency`)."""
    results = side_results(path, "efficiency")
    if results is None:
        return []
    from engine_lib.phases import PHASES

    w = results["workload"]
    lines = ["", "## Engine efficiency: served and in-process vs the offline batched limit", "",
             f"`make bench-efficiency`, started {results['started']}: Qwen-Image, {w['steps']} steps, the workload's "
             f"prompts cycling; offline is diffusers `pipe(prompt=[{w['batch']} prompts])` in a fresh process; the "
             f"in-process engine (step mode, `max_num_seqs={w['batch']}`) runs in another fresh process with "
             f"{w['batch']} closed-loop client threads; served is tritonserver with the same engine and "
             f"{w['batch']} closed-loop gRPC clients. Requests per point: " + ", ".join(
                 f"{p} {e['requests']}" for p, e in results["presets"].items()) + f" (the offline limit and runner: "
             f"as many images in calls of {w['batch']}, back to back); {w['repeats']} interleaved repeats (median, "
             "min-max). Goals (issue #14): served / offline >= 0.9, engine / offline >= 0.95.", "",
             "| preset | offline images/s | runner images/s | runner / offline | engine req/s | engine / offline | "
             "served req/s | served / offline |", "|---|---|---|---|---|---|---|---|"]
    for preset, e in results["presets"].items():
        lines.append(f"| {preset} {e['size']}x{e['size']} | {fmt_spread(spread(e['offline']))} | "
                     f"{fmt_spread(spread(e['runner']))} | {f(e['runner_over_offline'], 2, 'x')} | "
                     f"{fmt_spread(spread(e['engine']))} | {f(e['engine_over_offline'], 2, 'x')} | "
                     f"{fmt_spread(spread(e['served']))} | {f(e['served_over_offline'], 2, 'x')} |")
    sustained = all("offline_median_call" in e for e in results["presets"].values())
    lines += ["", ("offline and runner count their images over the total time of their calls, as the engine and "
                   "served points count requests over their whole run (a slow call counts in both). The median "
                   "call, the statistic of earlier runs, gave: " + "; ".join(
                       f"{p} offline {fmt_spread(spread(e['offline_median_call']))}, runner "
                       f"{fmt_spread(spread(e['runner_median_call']))} images/s"
                       for p, e in results["presets"].items()) + ".") if sustained else
              "offline and runner: each the median call's images/s (this run predates counting them over the total time)."]
    lines += ["", "runner: the engine's loop (`ModelRunner.run_to_completion`) over 8 requests admitted together, "
              "in a fresh process like offline: its per-tick code without threads or a closed loop. Between runner "
              "and engine lies what a closed loop does: requests join and finish at different ticks, so some "
              "forwards run part-full (in a per-tick trace of the tiny preset at concurrency 8, the clients "
              "settled into two cohorts of 4, and each tick after a cohort finished ran 4 rows: the finished "
              "clients' next requests arrived after it started)."]
    lines += ["", "Milliseconds per request in each phase (medians over repeats; engine thread, plus the sender's "
              "`encode` and `send` when served; engine_lib/phases.py):", "",
              "| phase | " + " | ".join(f"{p} engine | {p} served" for p in results["presets"]) + " |",
              "|---|" + "---|---|" * len(results["presets"])]
    for phase in PHASES:
        cells = []
        for e in results["presets"].values():
            for key in ("engine_phases", "served_phases"):
                values = [run.get(phase, 0.0) * 1000 / e["requests"] for run in e[key]]
                cells.append(f"{statistics.median(values):.2f}" if values else "-")
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    return lines


def size_batching_section(path: Optional[Path] = None) -> list[str]:
    """Mixed sizes: fused waves vs step batching with and without mixed_size_batching (`make bench-sizes`)."""
    results = side_results(path, "mixed_sizes")
    if results is None:
        return []
    by_variant = results["variants"]
    w = next(iter(by_variant.values()))["workload"]
    lines = ["", "## Mixed image sizes: fused waves vs step batching", "",
             f"`make bench-sizes`, started {results['started']}: Qwen-Image, sizes drawn from "
             f"{', '.join(map(str, w['sizes']))} (unless a heading says otherwise), {w['steps']} steps, closed loop at "
             f"concurrency {w['concurrency']}, "
             f"`max_num_seqs={w['max_num_seqs']}`, {w['repeats']} interleaved repeats (median, min-max); each "
             "variant in turn. The offline limit of a size mix is diffusers `pipe()` in batches of "
             f"{w['max_num_seqs']} of one size (fresh processes), combined over the mix: no server, no waiting, no "
             "size switches."]
    for variant, one in by_variant.items():
        sizes = one["workload"]["sizes"]
        drawn = "" if sizes == w["sizes"] else f", sizes drawn from {', '.join(map(str, sizes))}"
        lines += ["", f"**{variant}** ({one['workload']['preset']} preset{drawn}, "
                  f"{one['workload']['requests_per_point']} requests per point)", "",
                  "| system | req/s | p99 latency s | mean requests per forward | / fused | share of offline limit |",
                  "|---|---|---|---|---|---|"]
        shares = one.get("share_of_limit", {})
        for name, entry in one["systems"].items():
            rates = spread([p["requests_per_s"] for p in entry["points"]])
            p99 = spread([p.get("latency_p99_s") for p in entry["points"]])
            batches = spread([p["server"].get("mean_batch_size") for p in entry["points"]])
            ratio = one["step_over_fused"].get(name)
            lines.append(f"| {entry['label']} | {fmt_spread(rates, 3)} | {fmt_spread(p99, 2)} | "
                         f"{fmt_spread(batches)} | {f(ratio, 2, 'x') if ratio else '-'} | "
                         f"{f'{shares[name]:.0%}' if name in shares else '-'} |")
        offline = one.get("offline")
        if offline:
            rates = ", ".join(f"{size}x{size} {statistics.median(v):.2f}" for size, v in offline["images_per_s"].items())
            lines += ["", f"Offline images/s: {rates}; the limit of this mix {offline['limit_requests_per_s']:.2f} "
                      f"requests/s. Step at 1.3x fused would need {1.3 * shares['rb_fused_wait']:.0%} of it."]
    lines += ["", "Goal (issue #13): step >= 1.3x fused. With `mixed_size_batching` Qwen-Image packs the rows' image "
              "tokens into one sequence (docs/pipelines.md): projections and MLPs run on real tokens only, and the "
              "joint attention runs once per group of rows of one token count, unpadded. A fused wave ends at the "
              "first waiting request of another size (its mean requests per forward above), so what step batching can "
              "gain over fused waves is what fuller forwards save: about 1 / (the share of the offline limit "
              "fused waves reach). The offline limit is measured in fresh processes after each repeat's served "
              "points (medians of the repeats), so it sees the machine load they saw."]
    return lines


def packing_section(path: Optional[Path] = None) -> list[str]:
    """One forward over several sizes: packed vs per size vs padded (`make bench-packing`: results/packing.json;
    gpu.sh's run on CUDA: results/packing-gpu.json)."""
    results = side_results(path, "packing")
    if results is None:
        return []
    w = results["workload"]
    on_cpu = w["device"] == "cpu"

    def sides(sizes: list) -> str:
        return ", ".join(dict.fromkeys("x".join(map(str, size)) for size in sizes))

    def pixels(sizes: list) -> str:
        return "x".join(str(16 * n) for n in min(sizes, key=lambda s: s[0] * s[1])) + " to " + "x".join(
            str(16 * n) for n in max(sizes, key=lambda s: s[0] * s[1]))

    where = f"{w['threads']} thread" if on_cpu else f"`{w['device']}` in {w['dtype']}, each call synchronised"
    lines = ["", "## Mixed sizes in one forward: packed vs per size vs padded" + ("" if on_cpu else f" ({w['device']})"),
             "", f"`make bench-packing`, started {results['started']}: one process, {where}, each pipeline's tiny "
             f"transformer config widened to {w['heads']['num_attention_heads']} heads of "
             f"{w['heads']['attention_head_dim']} (random weights), 8 rows, {w['text_tokens']} text tokens; median of "
             f"{w['repeats']} interleaved calls. Workloads (patch tokens per side): "
             + "; ".join(f"{name}: {sides(sizes)} ({pixels(sizes)} px)" for name, sizes in w["sizes"].items())
             + ". Packed is `mixed_size_batching`'s forward (its joint attention once per token count); per size is "
             "diffusers' forward once per size (size-keyed step batching); padded is diffusers' forward of every row "
             "at the largest size (what padding computes).", "",
             "| pipeline | workload | packed ms | per size ms | padded ms | per size / packed | padded / packed |",
             "|---|---|---|---|---|---|---|"]
    for point in results["points"]:
        ms = point["median_ms"]
        lines.append(f"| {point['pipeline']} | {point['workload']} | {f(ms['packed'], 1)} | {f(ms['per_size'], 1)} | "
                     f"{f(ms['padded'], 1)} | {f(point['per_size_over_packed'], 2, 'x')} | "
                     f"{f(point['padded_over_packed'], 2, 'x')} |")
    ranges = {}
    for point in results["points"]:
        ranges.setdefault(point["workload"], []).append(point["per_size_over_packed"])
    lines += ["", "Per size / packed, over the pipelines: " + "; ".join(
                  f"{name} {f(min(values), 2)}-{f(max(values), 2, 'x')}" for name, values in ranges.items())
              + ". A packed forward adds per-token gathers, and runs each projection and MLP once over every row, "
              "where the per-size forwards run them once per size (so the more sizes, the more it saves); it never "
              "computes padding, and it lets rows of different sizes share a tick instead of each size waiting for a "
              "tick of its own (`make bench-sizes` measures that served)."]
    return lines


def slo_section(path: Optional[Path] = None) -> list[str]:
    """The Poisson mixed-steps load with SLOs sent as deadlines (`make bench-slo`: slo.json)."""
    results = side_results(path, "slo")
    if results is None:
        return []
    w = results["workload"]
    lines = ["", "## Deadlines: the Poisson mixed-steps load with each SLO sent as Triton's timeout", "",
             f"`make bench-slo`, started {results['started']}: `make bench`'s Poisson point ({w['requests']} requests, "
             f"{w['size']}x{w['size']}, steps from {', '.join(map(str, w['steps']))}, {w['load']:.0%} of REQUEST_BATCH "
             f"serial capacity: {rate_text(next(iter(results['systems'].values()))['points'], results['poisson_rate'])}"
             f", the same seeds); SLO {w['slo_factor']:g}x the solo "
             "latency of the request's shape, calibrated on REQUEST_BATCH serial in the same run; where sent, each "
             "request's timeout is its SLO. A request that times out before it starts counts as a miss. "
             f"{w['repeats']} rounds (median, min-max).", "",
             "| system | SLO attainment | p99 latency s | engine busy | timed out | errors |", "|---|---|---|---|---|---|"]
    for entry in results["systems"].values():
        points = entry["points"]
        lines.append(f"| {entry['label']} | {fmt_spread(spread([100 * p['slo_attainment'] for p in points]), 0)} % | "
                     f"{fmt_spread(spread([p['latency_p99_s'] for p in points]))} | "
                     f"{fmt_spread(spread([busy_share(p) for p in points]), percent=True)} | "
                     f"{', '.join(str(p.get('timed_out', 0)) for p in points)} | "
                     f"{', '.join(str(p['errors']) for p in points)} |")
    return lines + ordering_bound_lines(results)


def ordering_bound_lines(results: dict) -> list[str]:
    """slo_model's bound for the Poisson load at each round's own calibration (`poisson_model`; CPU runs only:
    the model's costs are this CPU's)."""
    model = results.get("poisson_model")
    if not model or results["machine"].get("gpu"):
        return []
    n = model["requests"]
    bounds = ", ".join(f"fewer than {n - 4}" if b is None else str(b) for b in model["on_time"])
    return ["", f"`benchmarks/slo_model.py`, a queue model at each round's own calibration, finds that no schedule of "
            f"this arrival sequence, even one preempting at any instant, finishes more than {bounds} of its {n} "
            "requests within their SLOs (round by round) if each request took its whole solo latency of server time "
            "and a step shared by n requests cost n solo steps: that is as far as ordering alone goes. Sharing steps "
            "goes further where a shared step costs less than the steps apart (the phase profile of `make bench`); "
            "`admission_order=deadline` shares them only where that pays (`python -m benchmarks.slo_model` models that "
            "too, at the profile's costs). The goal of issue #13, 95 %, is "
            f"{math.ceil(0.95 * n)} of these {n} requests."]


def priority_section(path: Optional[Path] = None) -> list[str]:
    """An urgent request alone and under a full background load (`make bench-priority`: priority.json)."""
    results = side_results(path, "priority")
    if results is None:
        return []
    w = results["workload"]
    labels = {"alone": "alone (idle server)",
              "preempt": "under load, priority 1, `max_preemptions=1` (pauses a background request)",
              "order": "under load, priority 1, `max_preemptions=0` (admitted first, waits for a slot)",
              "separate": "under load, priority 1, `priority_batching=separate` (pauses the whole background "
                          "batch, runs alone)",
              "fifo": "under load, priority 3 like the background (arrival order, the seed's)"}
    lines = ["", "## Priorities: an urgent request under a full background load", "",
             f"`make bench-priority`, started {results['started']}: the tiny Qwen-Image, {w['size']}x{w['size']}, "
             f"{w['steps']} steps, step mode with `max_num_seqs={w['max_num_seqs']}`. A background of "
             f"{w['background_clients']} closed-loop clients (priority 3) keeps every slot busy and requests "
             f"waiting; one foreground client sends {w['urgent_requests']} requests one after another "
             f"({w['gap_s']} s apart). Latency from send to the final response.", "",
             "| foreground | p50 ms | p99 ms | p99 / alone p99 | background requests done |", "|---|---|---|---|---|"]
    for name, entry in results["variants"].items():
        lines.append(f"| {labels.get(name, name)} | {entry['p50_s'] * 1000:.0f} | {entry['p99_s'] * 1000:.0f} | "
                     f"{entry['p99_over_alone_p99']:.2f}x | {entry['background_completed']} |")
    lines += ["", "Goal (issue #13): p99 under load <= 1.5x alone. On this CPU a step over a full batch of "
              f"{w['max_num_seqs']} costs more than a step over one request, so even an urgent request that never "
              "waits runs slower under load; the rows show how much of the rest priority and preemption remove. "
              "`priority_batching=separate` keeps the background out of the urgent request's forwards, at the "
              "background's expense (its requests done)."]
    return lines


def other_pipelines_section(results: dict) -> list[str]:
    """Serial vs continuous on the other pipelines' tiny presets; nothing for results without them (older runs)."""
    other = results.get("other_pipelines")
    if not other:
        return []
    plan = results["plan"]
    cs = [str(c) for c in plan.get("other_concurrencies", (1, 8))]
    top = "8" if "8" in cs else cs[-1]
    source = results.get("other_pipelines_source")
    lines = ["", "## Other pipelines (tiny presets)", "",
             f"These are the tiny random-weight presets of each pipeline: the numbers show that REQUEST_BATCH serial "
             f"and STEP_BATCH continuous work end to end on every pipeline, not model speed. Each system runs on its "
             f"own tritonserver (`model_repository/<pipeline>`, `max_sequence_length` "
             f"{plan.get('other_max_sequence_length', '-')}), one after the other after the main run; closed loop, "
             f"uniform {plan.get('other_size', '-')}x{plan.get('other_size', '-')}, {plan.get('other_steps', '-')} "
             f"steps, max({plan.get('other_rounds', '-')} x concurrency, {plan.get('other_min_requests', '-')}) requests "
             "per point, one run per point."
             + (f" From `{source}`." if source else ""), "",
             "| pipeline | system | " + " | ".join(f"req/s c={c} | p50 c={c} | p99 c={c}" for c in cs)
             + f" | step / serial req/s at c={top} | errors |",
             "|---|---|" + "---|---|---|" * len(cs) + "---|---|"]
    for pipeline, section in other.items():
        by_name = section.get("systems", {})
        serial = by_name.get(f"{pipeline}_serial", {}).get("closed", {}).get(top, {})
        for name, s in by_name.items():
            pts = s.get("closed", {})
            cells = " | ".join(f"{f(pts.get(c, {}).get('requests_per_s'), 3)} | "
                               f"{f(pts.get(c, {}).get('latency_p50_s'), 3, ' s')} | "
                               f"{f(pts.get(c, {}).get('latency_p99_s'), 3, ' s')}" for c in cs)
            step_ratio = ratio(pts.get(top, {}).get("requests_per_s"), serial.get("requests_per_s")) \
                if name.endswith("_step") else None
            errors = sum(p.get("errors", 0) for p in pts.values())
            lines.append(f"| {pipeline} | {s['label']} | {cells} | {f(step_ratio, 2, 'x')} | {errors} |")
    return lines


def with_other_pipelines(results: dict, source: Path) -> dict:
    """Results without the tiny-preset section (an older full run) borrow it from the newest results that have it."""
    if results.get("other_pipelines"):
        return results
    candidates = [p for p in (RESULTS_DIR / "full.json", RESULTS_DIR / "quick.json")
                  if p.is_file() and p.resolve() != source.resolve()]
    for path in candidates:
        other = json.loads(path.read_text())
        if other.get("other_pipelines"):
            keys = [k for k in other["plan"] if k.startswith("other_")]
            plan = {**results["plan"], **{k: other["plan"][k] for k in keys}}
            rel = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
            return {**results, "plan": plan, "other_pipelines": other["other_pipelines"],
                    "other_pipelines_source": f"{rel}, started {other.get('started', '?')}"}
    return results


def scheduling_targets(results: dict) -> list[dict]:
    """Issue #13's three targets from a benchmarks/scheduling.py run (the engine in-process), round by round."""
    plan, S = results["plan"], results["systems"]
    fused, out = S.get(FUSED_WAIT, {}), []
    for name in (STEP, STEP_MIXED):
        if rounds(S.get(name, {}), "mixed_sizes") and rounds(fused, "mixed_sizes"):
            out.append(target(f"Mixed sizes {tuple(plan['mixed_sizes'])}, c={plan['concurrency']}: {S[name]['label']} / "
                              f"{fused['label']}, requests/s", round_ratios(S[name], fused, "mixed_sizes",
                                                                           "requests_per_s"), 1.3, True))
    for name in (STEP, SRPT, DEADLINE):
        if rounds(S.get(name, {}), "poisson"):
            out.append(target(f"Poisson mixed steps: {S[name]['label']} SLO attainment",
                              [p.get("slo_attainment") for p in rounds(S[name], "poisson")], 0.95, True, unit="%"))
    for name, entry in results.get("urgent", {}).items():
        if "p99_over_alone_p99" in entry:
            out.append(target(f"Urgent request under a full background load: {S[name]['label']}, p99 / alone p99",
                              entry["p99_over_alone_p99"], 1.5, False))
    return out


def scheduling_headline(results: dict) -> str:
    return "scheduling (engine in-process): " + targets_line(scheduling_targets(results))


def scheduling_section(path: Optional[Path] = None, heading: str = "##") -> list[str]:
    """Issue #13's targets with the engine in-process (`make bench-scheduling`: scheduling.json; on the lent GPU
    machine benchmarks/device.sh: scheduling-gpu.json)."""
    results = side_results(path, "scheduling")
    if results is None:
        return []
    plan, machine, S = results["plan"], results["machine"], results["systems"]
    command = "make bench-scheduling" if plan["name"] == "cpu" else f"python -m benchmarks.scheduling --plan {plan['name']}"
    where = machine.get("gpu") or f"{machine['nproc']} CPUs"
    rate = rate_text(rounds(S.get(SERIAL, {}), "poisson"), results.get("poisson_rate"))
    lines = ["", f"{heading} Scheduling targets with the engine in-process ({where})", "",
             f"`{command}`, started {results['started']}: issue #13's targets with each system's engine in the "
             "benchmark's own process (benchmarks/in_process.py), no tritonserver and no gRPC; the engine, its "
             f"parameters and the requests' validation are the served ones. Qwen-Image `{plan['preset']}` in "
             f"{plan['dtype']} on {plan['device']}. `make bench`'s workloads: mixed sizes {tuple(plan['mixed_sizes'])} "
             f"({plan['mixed_steps']} steps) in a closed loop at concurrency {plan['concurrency']}; "
             f"{plan['poisson_requests']} requests of {plan['size']}x{plan['size']} with steps from "
             f"{tuple(plan['step_choices'])} arriving as a Poisson process at {plan['poisson_load']:.0%} of "
             f"REQUEST_BATCH serial capacity ({rate}), SLO {plan['slo_factor']:g}x "
             "the solo latency of the request's shape (calibrated on REQUEST_BATCH serial in the same run: "
             + ", ".join(f"{k} {v:.3f} s" for k, v in results.get("solo_latency_s", {}).items())
             + (" at the start, the Poisson shapes again before each round" if recalibrated(results) else "") + "). "
             f"`make bench-priority`'s: {plan['urgent_requests']} urgent requests ({plan['urgent_size']}x"
             f"{plan['urgent_size']}, {plan['urgent_steps']} steps, priority 1) one after another, alone and under "
             f"{plan['urgent_background']} closed-loop background clients (priority 3), `max_num_seqs` "
             f"{plan['urgent_max_num_seqs']}. {plan['repeats']} round(s) of the first two (median, min-max), each "
             "round every system once, a fresh engine over the loaded weights per point.", "",
             "| target | measured | goal | result |", "|---|---|---|---|"]
    lines += target_rows(scheduling_targets(results))
    lines += ["", "| system | mixed sizes req/s | Poisson SLO attainment | Poisson p99 s | Poisson engine busy | "
              "mean requests per forward (mixed sizes; Poisson) | errors |", "|---|---|---|---|---|---|---|"]
    for entry in S.values():
        mixed, poisson = rounds(entry, "mixed_sizes"), rounds(entry, "poisson")
        if not (mixed or poisson):
            continue
        batch = [fmt_spread(spread([p["server"].get("mean_batch_size") for p in points]), 1) for points in (mixed, poisson)]
        lines.append(f"| {entry['label']} | {fmt_spread(spread([p['requests_per_s'] for p in mixed]), 3)} | "
                     f"{fmt_spread(spread([p['slo_attainment'] for p in poisson]), percent=True)} | "
                     f"{fmt_spread(spread([p['latency_p99_s'] for p in poisson]))} | "
                     f"{fmt_spread(spread([busy_share(p) for p in poisson]), percent=True)} | {'; '.join(batch)} | "
                     f"{sum(p['errors'] for p in mixed + poisson)} |")
    lines += ordering_bound_lines(results) + retries_note(S)
    if results.get("wall_s") is None:
        lines += ["", "This run stopped before its end (its results were saved after each stage): the rows above "
                  "are what it measured."]
    return lines


def gpu_section(results: dict) -> list[str]:
    gpu = results["machine"].get("gpu")
    in_process = scheduling_section(RESULTS_DIR / "scheduling-gpu.json", heading="###")
    if gpu:
        return ["", "## GPU", "", f"This page was measured on {gpu} (device `{results['plan'].get('device')}`)."] \
            + gpu_sync_section() + packing_section(RESULTS_DIR / "packing-gpu.json") + in_process
    return ["", "## GPU", "",
            "Served numbers not measured yet: no GPU was available to the session that produced these numbers. On a "
            "CUDA host with tritonserver, `bash benchmarks/gpu.sh` runs the engine on CUDA with a larger random-weight "
            "preset, the four modes side by side, and writes `benchmarks/results/gpu.json` and "
            "`docs/benchmarks-gpu.md`. The GPU machine lent to some sessions has no tritonserver: there "
            "`bash benchmarks/device.sh` measures issue #13's targets with the engine in-process "
            "(`benchmarks/scheduling.py --plan gpu`; how to call it: the header of benchmarks/device.sh)"
            + (", below." if in_process else "; it has not run yet.")] + in_process


def gpu_sync_section() -> list[str]:
    """benchmarks/gpu_sync.py's count of host synchronisations per tick, when gpu.sh has run it."""
    path = RESULTS_DIR / "gpu_sync.json"
    if not path.exists():
        return []
    sync = json.loads(path.read_text())
    # before every pipeline was counted, the file held Qwen-Image's ticks alone
    pipelines = sync.get("pipelines") or {"qwen_image": sync["ticks"]}
    preset, size = sync.get("qwen_image_preset", sync.get("preset")), sync.get("qwen_image_size", sync.get("size"))
    lines = ["", f"Host synchronisations per engine tick on {sync['device']} (`python -m benchmarks.gpu_sync`, "
             f"Qwen-Image {preset} preset at {size}x{size}, the others tiny; {sync['steps']} steps; the goal: none "
             "while requests only denoise, one where outputs go to the host):", "",
             "| pipeline | tick | ticks | mean | max | first waits reported |", "|---|---|---|---|---|---|"]
    for name, ticks in pipelines.items():
        for kind, s in ticks.items():
            lines.append(f"| {name} | {kind} | {s['ticks']} | {f(s['syncs_mean'], 1)} | {s['syncs_max']} | "
                         f"{'; '.join(m[:80] for m in s['first_messages'][:2]) or '-'} |")
    return lines


def reproduce_section() -> list[str]:
    return ["", "## Reproduce", "",
            "```", "make bench-quick        # under 5 minutes: fewer points and requests, 4 steps",
            "make bench              # the full run (20-30 minutes on 2 CPUs)",
            "make bench-lora         # mixed vs LoRA-homogeneous step batching (a few minutes)",
            "make bench-sizes        # mixed image sizes: fused vs step, with and without mixed_size_batching",
            "make bench-packing      # one forward over two and eight sizes: packed vs per size vs padded (2 minutes)",
            "make bench-priority     # an urgent request alone and under a full background load (a few minutes)",
            "make bench-slo          # the Poisson load with SLOs sent as deadlines: shortest remaining vs deadline order",
            "python -m benchmarks.slo_model         # what ordering alone, and deadline order sharing steps, could do for that load (seconds)",
            "make bench-own          # BAGEL and HunyuanImage-3.0: step batching at concurrency 4 vs serial (a minute)",
            "make bench-efficiency   # served and in-process engine vs the offline limit, per-phase split (5 minutes)",
            "make bench-scheduling   # issue #13's targets with the engine in-process, no tritonserver",
            "python -m benchmarks.report            # re-render this page from benchmarks/results/",
            "python -m benchmarks.perf_analyzer --url 127.0.0.1:8001   # against a running `make serve`",
            "```"]


def headline(results: dict) -> str:
    """One line: the main ratios of a run."""
    return "bench: " + targets_line(targets(results))


def write_report(source: Optional[Path] = None, doc_path: Path = DOC_PATH) -> list[Path]:
    """Render the markdown page and its two plots (into img/ beside it); returns the written paths.

    Plots of a page other than docs/benchmarks.md get its name as a prefix, so they never collide.
    """
    source = Path(source) if source else newest_results()
    doc_path = Path(doc_path)
    results = json.loads(source.read_text())
    if doc_path.resolve() == DOC_PATH.resolve():
        results = with_other_pipelines(results, source)
    img_dir = doc_path.parent / "img"
    prefix = "" if doc_path.resolve() == DOC_PATH.resolve() else f"{doc_path.stem}-"
    img_dir.mkdir(parents=True, exist_ok=True)
    throughput, cdf = img_dir / f"{prefix}throughput.png", img_dir / f"{prefix}latency_cdf.png"
    plot_throughput(results, throughput)
    plot_latency_cdf(results, cdf)
    doc_path.parent.mkdir(parents=True, exist_ok=True)
    img_rel = Path(os.path.relpath(img_dir, doc_path.parent)).as_posix()
    doc_path.write_text(render(results, source.resolve(), img_rel, prefix))
    return [doc_path, throughput, cdf]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="render docs/benchmarks.md from a results JSON")
    parser.add_argument("results", nargs="?", default=None,
                        help="default: benchmarks/results/full.json, else quick.json")
    parser.add_argument("--doc", default=str(DOC_PATH), help="markdown page to write (default docs/benchmarks.md)")
    args = parser.parse_args(argv)
    paths = write_report(Path(args.results) if args.results else None, Path(args.doc))
    print("\n".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
