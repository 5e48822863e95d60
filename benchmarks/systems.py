"""The systems under test: one tritonserver each, on a temporary copy of a model repository.

A system is a model repository (ours or the naive baseline) plus the config.pbtxt `parameters` that select its
execution mode (the systems themselves are in benchmarks/scenarios.py). `scrape_metrics` reads the server's
Prometheus endpoint, where the engine publishes `diffusion_batch_size` and `diffusion_tick_seconds`."""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, Optional

from benchmarks.loadgen import PRIORITY_KEY, Target

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
BASELINE_REPOSITORY = Path(__file__).resolve().parent / "baseline_repository"


@dataclass(frozen=True)
class System:
    """A named server configuration: the pipeline, the repository and model that serve it, and the
    `parameters` it sets in that model's config.pbtxt. `deadlines`: the Poisson load sends each
    request's SLO to it as Triton's request timeout."""

    name: str
    label: str
    pipeline: str = "qwen_image"
    parameters: Mapping[str, str] = field(default_factory=dict)
    repository: Path = MODEL_REPOSITORY
    model: str = ""  # the Triton model name; "" = the pipeline's
    streaming: bool = True
    deadlines: bool = False
    adapter: Mapping[str, object] = field(default_factory=dict)  # in-process: attributes set on the adapter

    @property
    def model_name(self) -> str:
        return self.model or self.pipeline


def engine(device: str = "cpu", dtype: str = "float32", **parameters) -> dict:
    """An engine system's parameters (string values), warmed up at load."""
    return {"device": device, "dtype": dtype, "warmup": "true", **{k: str(v) for k, v in parameters.items()}}


def naive(device: str = "cpu") -> System:
    """The naive baseline: diffusers' pipe() per request behind Triton's dynamic batcher."""
    return System("naive", "naive baseline (pipe() per request, dynamic batcher)", "qwen_image",
                  {"device": device}, BASELINE_REPOSITORY, "qwen_image_naive", streaming=False)


def prepare_repository(system: System, model_path: Path, workdir: Path) -> Path:
    """A copy of the system's repository holding only its model, its config.pbtxt rewritten through Triton's own
    ModelConfig protobuf (comments and layout do not matter) with the system's parameters and model_path set."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    target = workdir / "model_repository"
    model = system.model_name
    shutil.copytree(system.repository / model, target / model, ignore=shutil.ignore_patterns("__pycache__"))
    path = target / model / "config.pbtxt"
    config = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    for key, value in {**system.parameters, "model_path": str(model_path)}.items():
        config.parameters[key].string_value = str(value)
    path.write_text(text_format.MessageToString(config))
    return target


@dataclass
class RunningSystem:
    system: System
    server: object  # engine_lib.serving.tritonserver.TritonServer
    target: Target


@contextlib.contextmanager
def serve(system: System, model_path: Path, log_dir: Optional[Path] = None,
          start_timeout_s: float = 600.0) -> Iterator[RunningSystem]:
    """Start tritonserver for `system` on free loopback ports; always stopped on exit."""
    from engine_lib.serving.processes import free_port
    from engine_lib.serving.tritonserver import TritonServer

    with tempfile.TemporaryDirectory(prefix=f"bench-{system.name}-") as tmp:
        repository = prepare_repository(system, model_path, Path(tmp))
        log_path = (log_dir / f"{system.name}.log") if log_dir else Path(tmp) / "tritonserver.log"
        if log_dir:
            log_dir.mkdir(parents=True, exist_ok=True)
            log_path.unlink(missing_ok=True)
        server = TritonServer(repository, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                              address="127.0.0.1", log_path=log_path, exit_timeout_s=5,
                              env={"DIFFUSION_PRIORITY_KEY": PRIORITY_KEY})
        try:
            server.start(timeout_s=start_timeout_s)
            yield RunningSystem(system, server, Target(server.grpc_url, system.model_name, system.streaming))
        finally:
            server.cleanup()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_OUTCOME = re.compile(r'outcome="([^"]*)"')


def scrape_metrics(metrics_url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over label sets} (histogram buckets skipped)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as reply:
            text = reply.read().decode("utf-8", "replace")
    except OSError:
        return {}
    return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, float]:
    """Each metric summed over its label sets, and each `outcome` label's sum as `name{outcome}`."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or match.group(1).endswith("_bucket"):
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        keys = [match.group(1)] + [f"{match.group(1)}{{{o}}}" for o in _OUTCOME.findall(match.group(2) or "")]
        for key in keys:
            out[key] = out.get(key, 0.0) + value
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
                "batch_retries": delta("diffusion_batch_retries_total"),  # batches that ran one by one instead
                **{f"cache_steps_{o}": delta(f"diffusion_cache_steps_total{{{o}}}") for o in ("computed", "reused")}}
    executions = delta("nv_inference_exec_count")
    if executions > 0:
        # Triton's compute duration counts a batch once per request in it: not a busy time.
        return {"mean_batch_size": delta("nv_inference_count") / executions, "ticks": executions}
    return {}
