"""`python -m engine_lib.serving.serve serve` as a test fixture: the whole served stack (supervisor,
tritonserver, front door) on free loopback ports, serving the qwen_image tiny model.

`Launcher` is started by a module (`module_launcher`, or tests/serving/test_supervision.py, which kills and stops its
own) or shared by the session as `secured` (tests/serving/conftest.py): every key the launcher takes is set, so
tests can check what each key opens and what stays closed without it.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

import pytest

from engine_lib.hooks import hooks_environment
from engine_lib.serving.processes import free_port
from tests.helpers.early_servers import process_tree, starts_early, take_early
from tests.helpers.servers import default_model_path, write_repository
from tests.helpers.streaming import run_request
from tests.helpers.waiting import TickBudget

MODEL = "qwen_image"
# The keys of the session's `secured` launcher.
ADMIN_KEY = "test-admin-key-0123456789"
PRIORITY_KEY = "test-priority-key-0123456789"
FRONT_DOOR_KEY = "test-front-door-key"
URGENT_FRONT_DOOR_KEY = "test-urgent-front-door-key"  # may ask the front door for priority 1
SECURED_ENV = {"TRITON_ADMIN_KEY": ADMIN_KEY, "DIFFUSION_PRIORITY_KEY": PRIORITY_KEY,
               "OPENAI_API_KEY": FRONT_DOOR_KEY, "OPENAI_PRIORITY_KEYS": f"{URGENT_FRONT_DOOR_KEY}=1"}


class Launcher:
    """`python -m engine_lib.serving.serve serve` on loopback ports, as `make serve` runs it."""

    def __init__(self, tmp: Path, model_dir: str, env: Optional[dict[str, str]] = None):
        self.budget = TickBudget(tmp / "tick_budget")
        self.repo = write_repository(tmp / "repository", model_path=model_dir)
        self.http, self.grpc, self.metrics, self.front = (free_port() for _ in range(4))
        self.log_path = tmp / "launcher.log"
        inherited = {k: v for k, v in os.environ.items() if k not in ("TRITON_ADDRESS", "TRITON_ADMIN_KEY", "MODELS")}
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "engine_lib.serving.serve", "serve", f"--model-repository={self.repo}",
                 f"--http-port={self.http}", f"--grpc-port={self.grpc}", f"--metrics-port={self.metrics}",
                 f"--openai-port={self.front}", f"--log-file={tmp / 'tritonserver.log'}", "--stub-drain=3"],
                env={**inherited, "OPENAI_API_KEY": "",
                     **hooks_environment(qwen_image={"tick_budget_path": str(self.budget.path)}), **(env or {})},
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.triton_log = tmp / "tritonserver.log"

    grpc_url = property(lambda self: f"127.0.0.1:{self.grpc}")
    metrics_url = property(lambda self: f"http://127.0.0.1:{self.metrics}/metrics")
    front_url = property(lambda self: f"http://127.0.0.1:{self.front}")
    triton_url = property(lambda self: f"http://127.0.0.1:{self.http}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def environ(self) -> dict[str, str]:
        """The port variables a probe in its environment reads (`serve ready`)."""
        return {"HTTP_PORT": str(self.http), "GRPC_PORT": str(self.grpc), "OPENAI_PORT": str(self.front),
                "METRICS_PORT": str(self.metrics)}

    def ready(self) -> bool:
        return http_status(f"{self.triton_url}/v2/health/ready") == 200

    def wait_serving(self, timeout_s: float) -> float:
        """Seconds until tritonserver is ready, its metrics answer and a request succeeds."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            assert self.process.poll() is None, self.log()
            if self.ready() and http_status(self.metrics_url) == 200 and http_status(f"{self.front_url}/health") == 200:
                result = run_request(self.grpc_url, prompt="probe", num_inference_steps=2, height=32, width=32)
                if result.num_final == 1 and not result.errors:
                    return time.monotonic() - start
            time.sleep(0.2)
        raise AssertionError(f"not serving after {timeout_s} s:\n{self.log()[-3000:]}")

    def pids(self) -> dict[str, int]:
        """The pids of its children by their command lines: "gate", "front door" and "tritonserver" (those running)."""
        found = {}
        for pid, argv in command_lines().items():
            if "engine_lib.serving.grpc_gate" in argv and f"127.0.0.1:{self.grpc}" in argv:
                found["gate"] = pid
            elif "engine_lib.serving.openai_api" in argv and str(self.front) in argv:
                found["front door"] = pid
            elif argv[0].endswith("/tritonserver") and f"--model-repository={self.repo}" in argv:
                found["tritonserver"] = pid
        return found

    def signal_tree(self, sig: int) -> list[int]:
        """Signal every process of the launcher's tree at once (its servers, stubs, gate and front door, whatever
        their process groups), as systemd's control-group kill and `docker stop` of a container's init do; the
        pids signalled."""
        tree = sorted(process_tree(self.process.pid))
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return tree

    def stubs(self) -> dict[int, list[str]]:
        """The Python stubs serving this repository's models: pid -> argv (argv[1] its model.py, argv[2] its
        shared-memory region)."""
        return {pid: argv for pid, argv in command_lines().items()
                if argv[0].endswith("triton_python_backend_stub") and len(argv) > 2
                and argv[1].startswith(f"{self.repo}/")}

    def stub(self) -> tuple[int, str]:
        """The qwen_image stub's pid and its shared-memory region name."""
        model_py = str(self.repo / MODEL / "1" / "model.py")
        for pid, argv in self.stubs().items():
            if argv[1] == model_py:
                return pid, argv[2]
        raise AssertionError("no stub process")

    def shm_regions(self) -> set[str]:
        return {p.name for p in Path("/dev/shm").glob(f"dtriton{self.process.pid}-*")}

    def stub_shm_bytes(self) -> int:
        """The size of the qwen_image stub's shared-memory region (it grows with what a request carries)."""
        return Path("/dev/shm", self.stub()[1]).stat().st_size

    def kill(self) -> None:
        """SIGKILL the launcher: its servers die with it, and their reapers (processes.start_reaper) kill their
        stubs and remove their shared memory. Whatever is still there 10 s later is removed here, so that
        a failing reaper fails its test (the last one in this module) rather than leaving stubs behind."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.stubs():
            time.sleep(0.1)
        for pid in self.stubs():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for name in self.shm_regions():
            Path("/dev/shm", name).unlink(missing_ok=True)


@contextlib.contextmanager
def serving(tmp: Path, model_dir: str, env: Optional[dict[str, str]] = None):
    """A new Launcher, serving once this is entered (its first request succeeded), killed on exit."""
    with served(Launcher(tmp, model_dir, env=env)) as launched:
        yield launched


@contextlib.contextmanager
def served(launched: Launcher):
    """A started Launcher, serving once this is entered (its first request succeeded), killed on exit."""
    try:
        launched.wait_serving(300)
        yield launched
    finally:
        launched.budget.release()
        launched.kill()


def command_lines() -> dict[int, list[str]]:
    """Every process's pid -> argv, from /proc (processes that end meanwhile are left out)."""
    found = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            found[int(cmdline.parent.name)] = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
    return found


def rss_bytes(pid: int) -> int:
    """The resident memory of process `pid` (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def http_status(url: str, headers: Optional[dict[str, str]] = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return 0


def raw_post(port: int, path: str, body: bytes, timeout: float = 30.0,
             headers: Optional[dict[str, str]] = None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        reply = connection.getresponse()
        return reply.status, reply.read()
    finally:
        connection.close()


def module_launcher(directory: str, env=None):
    """A module-scoped fixture: `serving` with `env`, started while the tests before
    its module run (tests/helpers/early_servers.py), killed after its module."""
    def start(tmp_path_factory):
        return Launcher(tmp_path_factory.mktemp(directory), default_model_path(), env=env)

    @pytest.fixture(scope="module")
    @starts_early(start, ahead=True)
    def fixture(tmp_path_factory):
        with served(take_early(start, tmp_path_factory)) as launched:
            yield launched
    return fixture
