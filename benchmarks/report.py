"""Markdown tables (tabulate) and plots (matplotlib) of one scenario's results JSON: `python -m benchmarks.report
benchmarks/results/<name>.json` prints the tables again. Every number is the median over the scenario's rounds;
"a (b-c)" is the median with the lowest and highest round."""

from __future__ import annotations

import functools
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Optional, Sequence

from tabulate import tabulate

from benchmarks.loadgen import percentile
from benchmarks.think import totals


def median(values: Sequence) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def num(value: Optional[float], digits: int = 3, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def spread(values: Sequence, digits: int = 3, scale: float = 1.0, suffix: str = "") -> str:
    """'median (min-max)' of a metric over rounds, or the one value."""
    values = [v * scale for v in values if v is not None]
    if not values:
        return "-"
    mid = num(statistics.median(values), digits, suffix)
    return mid if len(values) == 1 or min(values) == max(values) else (
        f"{mid} ({num(min(values), digits)}-{num(max(values), digits)})")


def table(rows: list, headers: Sequence[str]) -> str:
    return tabulate(rows, headers=list(headers), tablefmt="github", disable_numparse=True) + "\n"


def of(points: Sequence[dict], *keys: str) -> list:
    """A (nested) metric of each round, e.g. of(points, "server", "mean_batch_size")."""
    return [functools.reduce(lambda value, key: (value or {}).get(key), keys, point) for point in points]


def render(result: dict) -> str:
    sc, m = result["scenario"], result["machine"]
    lines = [f"### {sc['title']} (`{sc['name']}`)\n",
             f"`{result['command']}`, started {result['started']}, {result['wall_s'] / 60:.1f} min; "
             f"{m['cpus']} CPUs ({m['cpu_model']}), {m['ram_gib']} GiB, GPU: {m['gpu'] or 'none'}; torch {m['torch']}, "
             f"diffusers {m['diffusers']}; load average before {m['load_average']}.\n"]
    if "error" in result:
        lines.append(f"Failed: `{result['error']}`\n")
    elif sc["kind"] in TABLES:
        lines += TABLES[sc["kind"]](result)
    return "\n".join(lines) + "\n"


def closed_tables(result: dict) -> list[str]:
    sc, rows = result["scenario"], result["rows"]
    pipeline = {s["name"]: s["pipeline"] for s in sc["systems"]}
    cs, top = sc["concurrency"], max(sc["concurrency"])
    limit = (result.get("offline") or {}).get(str(top), {}).get("best_images_per_s")
    groups: dict = {}
    for row in rows:
        groups.setdefault((row["system"], row["variant"]), {})[row["concurrency"]] = row
    rows_each = sc.get("rows_per_request", 1)
    first: dict = {}
    out = []
    for (name, variant), by_c in groups.items():
        points = by_c[top]["points"]
        rate, forwards = median(of(points, "requests_per_s")), median(of(points, "server", "ticks"))
        base, base_forwards = first.setdefault(pipeline[name], (rate, forwards))
        line = [by_c[top]["label"] + (f", {variant}" if variant else "")]
        line += [spread(of(by_c[c]["points"], "requests_per_s")) for c in cs]
        if sc["num_frames"]:
            line.append(num(rate and rate * sc["num_frames"], 1))
        per_forward = median(of(points, "server", "mean_batch_size"))
        line += [num(median(of(points, "latency_p50_s")), 2), num(median(of(points, "latency_p99_s")), 2),
                 num(median(of(points, "first_preview_p50_s")), 2), num(per_forward, 2), num(forwards, 0)]
        if rows_each > 1:
            line.append(num(per_forward and per_forward * rows_each, 2))
        line += [str(sum(of(points, "errors"))), num(rate / base if rate and base else None, 2, "x"),
                 num(forwards / base_forwards if forwards and base_forwards else None, 2, "x")]
        if limit:
            line.append(num(rate / limit if rate else None, 2, "x"))
        out.append(line)
    headers = ["system"] + [f"req/s c={c}" for c in cs] + (["frames/s"] if sc["num_frames"] else []) + [
        f"p50 s c={top}", f"p99 s c={top}", f"first output p50 s c={top}", f"requests per forward c={top}",
        f"forwards c={top}"] + (
        [f"rows per forward c={top} ({rows_each} a request)"] if rows_each > 1 else []) + [
        "errors", "req/s / first row", "forwards / first row"] + ([f"/ offline limit (batch {top})"] if limit else [])
    tables = [table(out, headers)]
    if sc.get("compare_images"):
        tables.append(image_table(rows))
    if result.get("offline"):
        tables.append(table([[b, num(row["pipe"]["images_per_s"]), num(row["runner"]["images_per_s"])]
                             for b, row in result["offline"].items()],
                            ["offline batch", "pipe() images/s", "engine runner images/s"]))
    return tables


def image_table(rows: list) -> str:
    """Each compared system against its pipeline's first system, round by round: the throughput ratio, and its
    images against the same requests' (over every round)."""
    out = []
    for row in rows:
        diffs = [d for d in of(row["points"], "image_diff") if d]
        if diffs:
            levels = [d["max_level"] for d in diffs if d["max_level"] is not None]
            out.append([row["label"] + (f", {row['variant']}" if row["variant"] else ""), str(row["concurrency"]),
                        spread(of(row["points"], "throughput_vs_first"), 2, suffix="x"),
                        str(sum(d["compared"] for d in diffs)), str(max(levels)) if levels else "-",
                        str(sum(d["over_one_level"] for d in diffs)), str(sum(d["missing"] for d in diffs))])
    return table(out, ["system", "concurrency", "req/s / first row's, per round", "images compared with the first "
                       "row's", "max uint8 difference", "images over 1 level", "requests done in one system only"])


def median_round(points: Sequence[dict]) -> dict:
    """The round with the median SLO attainment (the lower middle of an even count)."""
    return sorted(points, key=lambda p: p.get("slo_attainment") or 0.0)[(len(points) - 1) // 2]


def poisson_tables(result: dict) -> list[str]:
    out, shapes = [], {}
    for row in result["rows"]:
        pts, p = row["points"], median_round(row["points"])
        busy = [(q["server"].get("device_busy_s") or 0) / q["duration_s"] if q["duration_s"] else None for q in pts]
        out.append([row["label"], num(p["offered_rate"]), num(p["requests_per_s"]),
                    spread(of(pts, "slo_attainment"), 0, 100, " %"), num(p["latency_p50_s"], 2),
                    num(p["latency_p99_s"], 2), num(p["first_preview_p50_s"], 2),
                    num(p["server"].get("mean_batch_size"), 2), spread(busy, 0, 100, " %"), str(p["timed_out"]),
                    str(p["errors"])])
        shapes[row["label"]] = p["slo_by_shape"]
    keys = sorted({k for v in shapes.values() for k in v}, key=lambda k: [int(x) for x in k.replace("x", "/").split("/")])
    return [table(out, ["system", "offered/s", "achieved/s", "SLO attainment", "p50 s", "p99 s", "first output p50 s",
                        "requests per forward", "engine busy", "timed out", "errors"]),
            table([[label] + [f"{v[k]['attainment']:.0%} ({v[k]['requests']})" if k in v else "-" for k in keys]
                   for label, v in shapes.items()], ["SLO attainment by shape (requests)"] + keys)]


def priority_tables(result: dict) -> list[str]:
    alone = percentile(result["rows"][0]["latencies_s"], 99)
    return [table([[r["label"], num(1000 * median(r["latencies_s"]), 0), num(1000 * percentile(r["latencies_s"], 99), 0),
                    num(percentile(r["latencies_s"], 99) / alone, 2, "x"), str(r["background_done"])]
                   for r in result["rows"]], ["urgent requests", "p50 ms", "p99 ms", "p99 / alone p99",
                                              "background requests done"])]


def perf_analyzer_tables(result: dict) -> list[str]:
    s, e, cmp = result.get("summary", {}), result.get("export", {}), result.get("comparison", {})
    rows = [["perf_analyzer 'Avg latency'", num(s.get("avg_latency_s"))],
            ["first response, from --profile-export-file", num(e.get("first_response_mean_s"))],
            ["last response (end to end), from --profile-export-file", num(e.get("e2e_mean_s"))],
            ["load generator, same requests, before and after", num(cmp.get("loadgen_mean_s"))]]
    return [f"`{result.get('perf_analyzer_command')}`: {s.get('decoupled_note', '')}\n",
            table(rows, ["mean latency", "seconds"]),
            table([[num(s.get("throughput_per_s")), num(e.get("responses_per_request"), 1),
                    result.get("avg_latency_matches") or "-", num(cmp.get("relative_difference"), 2)]],
                  ["perf_analyzer requests/s", "responses per request", "'Avg latency' matches the",
                   "export vs load generator, relative difference"])]


def profile_tables(result: dict) -> list[str]:
    p = result["profile"]
    solo, batched, n = p["batch_1"], p[f"batch_{p['batch']}"], p["batch"]
    phases = [("prompt encode (once)", "encode_s_per_request"), ("one denoise step", "denoise_step_s_per_request"),
              ("one scheduler step", "scheduler_step_s_per_request"), ("VAE decode (once)", "decode_s_per_request"),
              (f"whole request ({p['steps']} steps)", "request_s_per_request")]
    one = p["step_s_by_rows"]["1"] if "1" in p["step_s_by_rows"] else p["step_s_by_rows"][1]
    return [table([[label, num(solo[k], 4), num(batched[k], 4), num(solo[k] / batched[k], 2, "x")] for label, k in phases],
                  [f"seconds per request, {p['size']}x{p['size']}", "solo", f"batch {n}", "batching speed-up"]),
            table([[rows, num(s, 4), num(s / one, 2, "x")] for rows, s in p["step_s_by_rows"].items()],
                  ["rows in one denoise step", "seconds", "/ one row"])]


def packing_tables(result: dict) -> list[str]:
    kinds = ("packed", "packed_flex", "per_size", "padded")
    return [table([[p["pipeline"], p["workload"], *(num(p["median_ms"].get(k), 1) for k in kinds),
                    num(p["per_size_over_packed"], 2, "x"), num(p["padded_over_packed"], 2, "x")]
                   for p in result["points"]],
                  ["pipeline", "rows", "packed ms", "packed flex ms", "per size ms", "padded ms", "per size / packed",
                   "padded / packed"])]


def psnr(image: "np.ndarray", reference: "np.ndarray") -> float:
    """PSNR in dB of a uint8 image against a reference (inf when equal)."""
    import numpy as np

    mse = float(np.mean((image.astype(np.float64) - reference.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def cache_saving(point: dict, blocks: int) -> Optional[float]:
    """The share of transformer block evaluations the cache saved, counted from its decisions: a reused step
    runs 1 of `blocks` blocks (None: no decision counted)."""
    computed, reused = point["server"].get("cache_steps_computed", 0), point["server"].get("cache_steps_reused", 0)
    return reused * (blocks - 1) / (blocks * (computed + reused)) if computed + reused else None


def cache_tables(result: dict) -> list[str]:
    """Each arm's throughput, engine time and decisions, and the speed-up against the ideal the counts allow:
    1 / (1 - share of block evaluations saved); the goal is a measured speed-up of at least 70 % of it."""
    rounds, blocks, threshold = result["rounds"], result["blocks"], result["scenario"]["cache_threshold"]
    rows = []
    for arm, label in (("off", "cache off"), ("first_block", f"first_block, threshold {threshold:g}")):
        points = [r[arm] for r in rounds]
        psnrs = [v for r in rounds for v in r["psnr_db"]] if arm == "first_block" else []
        rows.append([label, spread(of(points, "requests_per_s")), num(median(of(points, "latency_p50_s")), 2),
                     num(median(of(points, "server", "device_busy_s")), 2),
                     f"{sum(of(points, 'server', 'cache_steps_reused'), 0.0):.0f} / "
                     f"{sum(of(points, 'server', 'cache_steps_computed'), 0.0):.0f}",
                     num(median([cache_saving(p, blocks) for p in points]), 2),
                     f"{num(statistics.mean(psnrs), 1)} / {num(min(psnrs), 1)}" if psnrs else "-",
                     str(sum(of(points, "errors")))])
    ratio = [r["first_block"]["requests_per_s"] / r["off"]["requests_per_s"] for r in rounds
             if r["first_block"]["requests_per_s"] and r["off"]["requests_per_s"]]
    engine = [r["off"]["server"]["device_busy_s"] / r["first_block"]["server"]["device_busy_s"] for r in rounds
              if r["first_block"]["server"].get("device_busy_s") and r["off"]["server"].get("device_busy_s")]
    saved = median([cache_saving(r["first_block"], blocks) for r in rounds])
    ideal = 1 / (1 - saved) if saved is not None else None
    goal = median(ratio) and ideal and median(ratio) / ideal
    return [table(rows, ["arm", "req/s", "p50 s", "engine busy s", "steps reused / computed",
                         f"block evaluations saved ({blocks} blocks)", "PSNR dB vs off, mean / min", "errors"]),
            table([[spread(ratio, 2, suffix="x"), spread(engine, 2, suffix="x"), num(ideal, 2, "x"),
                    num(goal and 100 * goal, 0, " %"), "-" if goal is None else "yes" if goal >= 0.7 else "no"]],
                  ["throughput on / off", "engine time off / on", "ideal 1 / (1 - saved)",
                   "measured / ideal", "goal (>= 70 %) met"])]


def think_tables(result: dict) -> list[str]:
    """Each system's counted work over every round, side by side, and the first system's ratios to each other's."""
    sc, rounds = result["scenario"], result["rounds"]
    names = [s["name"] for s in sc["systems"]]
    labels = {s["name"]: s["label"] for s in sc["systems"]}
    t = {name: totals(rounds, name) for name in names}
    points = {name: [r["systems"][name] for r in rounds] for name in names}
    rows = [[labels[name], str(t[name]["text_forwards"]), num(t[name]["text_rows_per_forward"], 2),
             str(t[name]["denoise_forwards"]), num(t[name]["denoise_rows_per_forward"], 2),
             spread(of(points[name], "requests_per_s")), num(median(of(points[name], "latency_p50_s", "think")), 2),
             num(median(of(points[name], "latency_p50_s", "plain")), 2),
             "yes" if all(of(points[name], "texts_equal")) else "no", str(max(of(points[name], "image_max_level")))]
            for name in names]
    base = t[names[0]]
    ratios = [[labels[name], num(t[name]["text_forwards"] / base["text_forwards"], 2, "x"),
               num(t[name]["denoise_forwards"] / base["denoise_forwards"], 2, "x"),
               spread([r["systems"][names[0]]["requests_per_s"] / r["systems"][name]["requests_per_s"]
                       for r in rounds], 2, suffix="x")] for name in names[1:]]
    return [table(rows, ["system", "text forwards", "rows per text forward", "denoise forwards",
                         "rows per denoise forward", "req/s", "p50 s think", "p50 s plain",
                         f"texts = {names[0]}'s", f"image levels from {names[0]}'s (max)"]),
            table(ratios, ["system", f"text forwards / {names[0]}'s", f"denoise forwards / {names[0]}'s",
                           f"{names[0]} req/s / its, per round"])]


def levers_tables(result: dict) -> list[str]:
    lv = result["levers"]
    eager = next((p for p in lv["points"] if p["arm"] == "eager"), None)
    rows = []
    for p in lv["points"]:
        if "refused" in p:
            rows.append([p["arm"], p["refused"], "", "", "", "", ""])
            continue
        speed = num(eager["step_s"] / p["step_s"], 2, "x") if eager else ""
        rows.append([p["arm"], num(p["step_s"], 4), speed, f"{p['transformer_bytes'] / 2**20:.1f}",
                     num(p["psnr_db"], 1), str(p["max_levels"]), num(p["warmup_s"], 1)])
    return [table(rows, [f"{lv['batch']} x {lv['size']}x{lv['size']}, {lv['steps']} steps, {lv['device']} "
                         f"{lv['dtype']}", "s per step", "vs eager", "transformer MiB",
                         "PSNR dB (worst image, vs eager float32)", "max levels", "warm-up s (compile)"])]


TABLES = {"closed": closed_tables, "poisson": poisson_tables, "priority": priority_tables,
          "perf_analyzer": perf_analyzer_tables, "profile": profile_tables, "packing": packing_tables,
          "cache": cache_tables, "think": think_tables, "levers": levers_tables}


def plot(result: dict, path: Path) -> Optional[Path]:
    """Requests/s against concurrency (closed loop over several concurrencies), or the latency CDF of each
    system's median round (Poisson); None for the other scenarios."""
    sc = result["scenario"]
    curves = sc["kind"] == "closed" and len(sc["concurrency"]) > 1
    if "error" in result or not (curves or sc["kind"] == "poisson"):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    if curves:
        for row_label in dict.fromkeys((r["label"], r["variant"]) for r in result["rows"]):
            rows = [r for r in result["rows"] if (r["label"], r["variant"]) == row_label]
            ax.plot([r["concurrency"] for r in rows], [median(of(r["points"], "requests_per_s")) for r in rows],
                    marker="o", label=", ".join(filter(None, row_label)))
        for batch, row in (result.get("offline") or {}).items():
            ax.axhline(row["best_images_per_s"], linestyle=":", color="grey")
            ax.annotate(f"offline limit, batch {batch}", (sc["concurrency"][0], row["best_images_per_s"]), fontsize=8)
        ax.set(xscale="log", xlabel="concurrency (closed loop)", ylabel="requests/s", xticks=sc["concurrency"])
        ax.set_xticklabels([str(c) for c in sc["concurrency"]])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
    else:
        for row in result["rows"]:
            point = median_round(row["points"])
            latencies = sorted(point["latencies_s"])
            ax.step(latencies, [(i + 1) / point["requests"] for i in range(len(latencies))], where="post",
                    label=row["label"])
        ax.set(xlabel="latency from arrival, s", ylabel="share of requests done")
    ax.set_title(sc["title"], fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(render(json.loads(Path(name).read_text())))
