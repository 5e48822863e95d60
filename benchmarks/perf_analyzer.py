"""perf_analyzer against the streaming (decoupled) model, and its end-to-end latency.

For a decoupled model perf_analyzer measures latency to the FIRST response (EXPLANATION), so both latencies are derived
from its `--profile-export-file`; `which_latency` says which of the two its own "Avg latency" actually matches
(measured, not assumed), and `compare` checks the end-to-end figure against the load generator at the same concurrency.

CLI: `python -m benchmarks.perf_analyzer --url 127.0.0.1:8001 --concurrency 4` against a running server (e.g.
`make serve`, with its TRITON_ADMIN_KEY in the environment: perf_analyzer reads the server's statistics, which need
the key; docs/serving.md, Admin APIs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from benchmarks.loadgen import spec_values
from benchmarks.workloads import PROMPTS, RequestSpec
from engine_lib.serving.processes import REPO_ROOT, hide_argument
from engine_lib.serving.tritonserver import ADMIN_HEADER

EXPLANATION = ("For a decoupled model perf_analyzer measures latency to the FIRST response (here a preview, not the "
               "image), so both latencies are derived from its --profile-export-file instead: first response, and "
               "end to end (the last response's timestamp minus the request's).")


def perf_analyzer_binary() -> str:
    """`.venv/bin/perf_analyzer_local` (made by scripts/setup.sh), else perf_analyzer on PATH."""
    local = REPO_ROOT / ".venv" / "bin" / "perf_analyzer_local"
    found = str(local) if local.is_file() else shutil.which("perf_analyzer_local") or shutil.which("perf_analyzer")
    if not found:
        raise FileNotFoundError("perf_analyzer not found: run `bash scripts/setup.sh`")
    return found


def input_data(spec: RequestSpec) -> dict:
    """perf_analyzer --input-data JSON for one request spec (every request sends the same inputs)."""
    return {"data": [{name: {"content": [value], "shape": [1]} for name, _, value in spec_values(spec)}]}


def command(url: str, model: str, data_path: Path, export_path: Path, concurrency: int,
            request_count: int) -> list[str]:
    """perf_analyzer reads the server's statistics after each measurement and stops without them; the
    launcher's servers answer statistics only with their admin key. With TRITON_ADMIN_KEY set it goes as
    the gRPC header tritonserver expects (perf_analyzer's -H reaches gRPC calls too, measured on 2.51)."""
    key = admin_key()
    return [perf_analyzer_binary(), "-m", model, "-u", url, "-i", "grpc", "--streaming",
            "--input-data", str(data_path), "--concurrency-range", f"{concurrency}:{concurrency}",
            "--request-count", str(request_count), "--profile-export-file", str(export_path)] + (
        ["-H", f"triton-grpc-protocol-{ADMIN_HEADER}:{key}"] if key else [])


def admin_key() -> str:
    return os.environ.get("TRITON_ADMIN_KEY", "").strip()


def parse_stdout(text: str) -> dict:
    """The summary perf_analyzer prints: throughput and its latencies (seconds), and its decoupled-mode note."""
    note = re.search(r"^\s*(Detected decoupled model.*)$", text, re.MULTILINE)
    out = {"decoupled_note": note.group(1).strip()} if note else {}
    patterns = {
        "throughput_per_s": r"(?m)^\s*Throughput:\s*([\d.]+)\s*infer/sec",
        "response_throughput_per_s": r"Response Throughput:\s*([\d.]+)\s*infer/sec",
        "avg_latency_s": r"Avg latency:\s*(\d+)\s*usec",
        "p50_latency_s": r"p50 latency:\s*(\d+)\s*usec",
        "p99_latency_s": r"p99 latency:\s*(\d+)\s*usec",
    }
    for key, pattern in patterns.items():
        match = re.search(pattern, text)
        if match:
            value = float(match.group(1))
            out[key] = value if key.endswith("per_s") else value / 1e6
    return out


def parse_export(data: dict) -> dict:
    """End-to-end and first-response latencies (seconds) from a --profile-export-file JSON."""
    e2e, first, responses = [], [], []
    for experiment in data.get("experiments", []):
        for request in experiment.get("requests", []):
            stamps = request.get("response_timestamps") or []
            if not stamps:
                continue
            sent = request["timestamp"]
            e2e.append((max(stamps) - sent) / 1e9)
            first.append((min(stamps) - sent) / 1e9)
            responses.append(len(stamps))
    if not e2e:
        return {"requests": 0}
    return {"requests": len(e2e), "e2e_mean_s": float(np.mean(e2e)), "e2e_p50_s": float(np.percentile(e2e, 50)),
            "e2e_p99_s": float(np.percentile(e2e, 99)), "first_response_mean_s": float(np.mean(first)),
            "responses_per_request": float(np.mean(responses))}


def run(url: str, model: str, spec: RequestSpec, concurrency: int, request_count: int,
        timeout_s: float = 600.0) -> dict:
    """Run perf_analyzer once; its stdout summary, the export-derived latencies and the command."""
    with tempfile.TemporaryDirectory(prefix="perf-analyzer-") as tmp:
        data_path, export_path = Path(tmp) / "input.json", Path(tmp) / "export.json"
        data_path.write_text(json.dumps(input_data(spec)))
        cmd = command(url, model, data_path, export_path, concurrency, request_count)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        key = admin_key()
        if key:
            hide_argument(proc, key)  # out of ps, as the launcher does for tritonserver
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        shown = [Path(c).name if i == 0 or c.startswith(tmp) else c for i, c in enumerate(cmd)]
        result = {"perf_analyzer_command": " ".join(c.replace(key, "$TRITON_ADMIN_KEY") if key else c for c in shown),
                  "returncode": proc.returncode, "concurrency": concurrency, "request_count": request_count,
                  "explanation": EXPLANATION}
        if proc.returncode != 0:
            result["error"] = (stderr or stdout)[-2000:]
            return result
        result["summary"] = parse_stdout(stdout)
        result["export"] = parse_export(json.loads(export_path.read_text())) if export_path.is_file() else {}
        result["avg_latency_matches"] = which_latency(result)
        return result


def which_latency(perf: dict) -> Optional[str]:
    """'first response' or 'last response': which export-derived mean perf_analyzer's Avg latency matches."""
    avg = perf.get("summary", {}).get("avg_latency_s")
    export = perf.get("export", {})
    if avg is None or "e2e_mean_s" not in export:
        return None
    nearer_first = abs(avg - export["first_response_mean_s"]) < abs(avg - export["e2e_mean_s"])
    return "first response" if nearer_first else "last response"


def compare(perf: dict, loadgen_mean_latency_s: Optional[float], margin: float = 0.20) -> dict:
    """Does perf_analyzer's derived end-to-end mean latency match the load generator's within `margin`?

    The default margin, 20 %, is about the run-to-run spread of one load-generator point on a small
    shared CPU machine (two identical runs a minute apart can differ by that much).
    """
    derived = perf.get("export", {}).get("e2e_mean_s")
    if derived is None or not loadgen_mean_latency_s:
        return {"margin": margin, "within_margin": None}
    diff = abs(derived - loadgen_mean_latency_s) / loadgen_mean_latency_s
    return {"margin": margin, "relative_difference": diff, "within_margin": diff <= margin,
            "perf_analyzer_e2e_mean_s": derived, "loadgen_mean_s": loadgen_mean_latency_s}


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="perf_analyzer on the streaming model, with end-to-end latency")
    parser.add_argument("--url", default="127.0.0.1:8001")
    parser.add_argument("--model", default="qwen_image")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--preview-interval", type=int, default=4)
    args = parser.parse_args(argv)
    spec = RequestSpec(PROMPTS[0], args.size, args.size, args.steps, seed=0, preview_interval=args.preview_interval)
    result = run(args.url, args.model, spec, args.concurrency, args.requests)
    print(EXPLANATION)
    print(json.dumps(result, indent=2))
    return 0 if result["returncode"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
