"""The systems under test: one tritonserver each, on a temporary copy of a model repository.

A system is a model repository (ours or the naive baseline) plus the
`parameters` that select its execution mode. `serve(system, ...)` copies the
repository, rewrites config.pbtxt through Triton's own ModelConfig protobuf (so
comments and layout do not matter), starts the server on free ports and stops
it afterwards. `scrape_metrics` reads the Prometheus endpoint, where the engine
publishes `diffusion_batch_size` (requests per forward) and
`diffusion_tick_seconds` (device time per tick).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, Optional

from benchmarks.loadgen import Target

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
BASELINE_REPOSITORY = Path(__file__).resolve().parent / "baseline_repository"


@dataclass(frozen=True)
class System:
    """A named server configuration: which repository/model, and the parameters it overrides."""

    name: str
    label: str
    repository: Path
    model: str
    streaming: bool = True
    parameters: Mapping[str, str] = field(default_factory=dict)


def default_systems(max_num_seqs: int = 8, wait_ms: float = 20.0, device: str = "cpu",
                    dtype: str = "float32") -> list[System]:
    """(a) serial, (b) fused with and without admission wait, (c) continuous step batching (and, for
    mixed sizes, with `mixed_size_batching`; for latency under Poisson load, two seats in
    shortest-remaining order, and two in deadline order, which the Poisson load sends its SLOs as
    Triton timeouts), (d) naive baseline."""
    engine = dict(device=device, dtype=dtype, warmup="true")
    return [
        System("rb_serial", "REQUEST_BATCH serial", MODEL_REPOSITORY, "qwen_image",
               parameters={**engine, "step_execution": "false", "max_num_seqs": "1"}),
        System("rb_fused", f"REQUEST_BATCH fused x{max_num_seqs}", MODEL_REPOSITORY, "qwen_image",
               parameters={**engine, "step_execution": "false", "max_num_seqs": str(max_num_seqs),
                           "request_batch_max_wait_ms": "0"}),
        System("rb_fused_wait", f"REQUEST_BATCH fused x{max_num_seqs} + {wait_ms:g} ms wait", MODEL_REPOSITORY,
               "qwen_image", parameters={**engine, "step_execution": "false", "max_num_seqs": str(max_num_seqs),
                                         "request_batch_max_wait_ms": f"{wait_ms:g}"}),
        System("step", f"STEP_BATCH continuous x{max_num_seqs}", MODEL_REPOSITORY, "qwen_image",
               parameters={**engine, "step_execution": "true", "max_num_seqs": str(max_num_seqs)}),
        System("step_mixed", f"STEP_BATCH continuous x{max_num_seqs}, mixed_size_batching", MODEL_REPOSITORY,
               "qwen_image", parameters={**engine, "step_execution": "true", "max_num_seqs": str(max_num_seqs),
                                         "mixed_size_batching": "true"}),
        System("step_srpt", "STEP_BATCH x2, shortest remaining first", MODEL_REPOSITORY, "qwen_image",
               parameters={**engine, "step_execution": "true", "max_num_seqs": "2",
                           "admission_order": "shortest_remaining", "max_preemptions": "1"}),
        System("step_deadline", "STEP_BATCH x2, deadline order (SLOs sent as timeouts)", MODEL_REPOSITORY,
               "qwen_image", parameters={**engine, "step_execution": "true", "max_num_seqs": "2",
                                         "admission_order": "deadline", "max_preemptions": "3"}),
        System("naive", "naive baseline (pipe() per request, dynamic batcher)", BASELINE_REPOSITORY,
               "qwen_image_naive", streaming=False, parameters={"device": device}),
    ]


def tiny_pipeline_systems(pipeline: str, max_num_seqs: int = 8, device: str = "cpu", dtype: str = "float32",
                          max_sequence_length: int = 32) -> list[System]:
    """REQUEST_BATCH serial and STEP_BATCH continuous for another pipeline (flux, sd3) on its own repository.

    A short text length keeps the tiny presets cheap; the modes are what is shown, not model speed.
    """
    engine = dict(device=device, dtype=dtype, warmup="true", max_sequence_length=str(max_sequence_length))
    return [
        System(f"{pipeline}_serial", f"{pipeline} REQUEST_BATCH serial", MODEL_REPOSITORY, pipeline,
               parameters={**engine, "step_execution": "false", "max_num_seqs": "1"}),
        System(f"{pipeline}_step", f"{pipeline} STEP_BATCH continuous x{max_num_seqs}", MODEL_REPOSITORY, pipeline,
               parameters={**engine, "step_execution": "true", "max_num_seqs": str(max_num_seqs)}),
    ]


def rewrite_config(config_path: Path, parameters: Mapping[str, str]) -> None:
    """Set `parameters` (string values) in a config.pbtxt, keeping everything else."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse(config_path.read_text(), model_config_pb2.ModelConfig())
    for key, value in parameters.items():
        config.parameters[key].string_value = str(value)
    config_path.write_text(text_format.MessageToString(config))


def prepare_repository(system: System, model_path: Path, workdir: Path) -> Path:
    """A copy of the system's repository holding only its model, with parameters and model_path set."""
    target = workdir / "model_repository"
    shutil.copytree(system.repository / system.model, target / system.model,
                    ignore=shutil.ignore_patterns("__pycache__"))
    rewrite_config(target / system.model / "config.pbtxt", {**system.parameters, "model_path": str(model_path)})
    return target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningSystem:
    system: System
    server: object  # engine_lib.serving.launcher.TritonServer
    target: Target

    @property
    def pid(self) -> Optional[int]:
        process = getattr(self.server, "process", None)
        return None if process is None else process.pid


@contextlib.contextmanager
def serve(system: System, model_path: Path, log_dir: Optional[Path] = None,
          start_timeout_s: float = 600.0) -> Iterator[RunningSystem]:
    """Start tritonserver for `system` on free loopback ports; always stopped on exit."""
    from engine_lib.serving.launcher import TritonServer

    with tempfile.TemporaryDirectory(prefix=f"bench-{system.name}-") as tmp:
        repository = prepare_repository(system, model_path, Path(tmp))
        log_path = (log_dir / f"{system.name}.log") if log_dir else Path(tmp) / "tritonserver.log"
        if log_dir:
            log_dir.mkdir(parents=True, exist_ok=True)
            log_path.unlink(missing_ok=True)
        server = TritonServer(repository, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                              address="127.0.0.1", log_path=log_path, exit_timeout_s=5)
        try:
            server.start(timeout_s=start_timeout_s)
            yield RunningSystem(system, server, Target(server.grpc_url, system.model, system.streaming))
        finally:
            server.cleanup()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def scrape_metrics(metrics_url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over label sets} (histogram buckets skipped)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as reply:
            text = reply.read().decode("utf-8", "replace")
    except OSError:
        return {}
    return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or match.group(1).endswith("_bucket"):
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        out[match.group(1)] = out.get(match.group(1), 0.0) + value
    return out


def batch_stats(before: Mapping[str, float], after: Mapping[str, float]) -> dict:
    """Mean requests per forward, device-busy seconds and batches retried one by one between two scrapes.

    Ours: the engine's diffusion_batch_size / diffusion_tick_seconds histograms.
    The baseline: Triton's nv_inference_count / nv_inference_exec_count (dynamic batcher).
    """
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    ticks = delta("diffusion_batch_size_count")
    if ticks > 0:
        return {"mean_batch_size": delta("diffusion_batch_size_sum") / ticks, "ticks": ticks,
                "device_busy_s": delta("diffusion_tick_seconds_sum"),
                "batch_retries": delta("diffusion_batch_retries_total")}  # batches that ran one by one instead
    executions = delta("nv_inference_exec_count")
    if executions > 0:
        # Triton's compute duration counts a batch once per request in it: not a busy time.
        return {"mean_batch_size": delta("nv_inference_count") / executions, "ticks": executions}
    return {}
