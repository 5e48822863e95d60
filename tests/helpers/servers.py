"""Real tritonservers for the tests: the repository's qwen_image model, copied to a tmp dir with parameters
adjusted per test module, served on free loopback ports.

`start_server` serves one with the engine's test hooks (a tick budget file, `server.budget`, a prompt that fails,
FAIL_PROMPT, and one whose latents turn NaN, NAN_PROMPT); `module_server` makes a module-scoped fixture of it, started
while the modules before it run (tests/helpers/early_servers.py). Every server started here is checked for leaks when
it stops (`LeakProbe`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from engine_lib.hooks import hooks_environment
from engine_lib.serving.processes import REPO_ROOT, free_port, proc_stat
from engine_lib.serving.tritonserver import TritonServer
from tests.helpers.early_servers import serve_early, starts_early
from tests.helpers.waiting import TickBudget

MODEL_DIR = REPO_ROOT / "model_repository" / "qwen_image"
FAIL_PROMPT = "__fail in the denoise step__"  # the shared server's injected failure (engine_lib/hooks.py)
NAN_PROMPT = "__nan in the latents__"  # the shared server turns this request's latents into NaN before each step
SERVER_PRIORITY_KEY = "test-server-priority-key"  # DIFFUSION_PRIORITY_KEY of every server start_server starts
URGENT = {"priority_key": SERVER_PRIORITY_KEY}  # the request parameters that may ask for a level above the default


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie lasts until init reaps it)."""
    try:
        return proc_stat(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def set_parameter(config_text: str, key: str, value: str) -> str:
    """Replace (or add) one `parameters` entry of a config.pbtxt."""
    entry = f'parameters: {{ key: "{key}", value: {{ string_value: "{value}" }} }}'
    pattern = re.compile(r'parameters:\s*\{\s*key:\s*"' + re.escape(key) + r'"[^\n]*\}\s*\}')
    if pattern.search(config_text):
        return pattern.sub(lambda _: entry, config_text)
    return config_text.rstrip("\n") + "\n" + entry + "\n"


def write_repository(root: Path, instance_group: str = "", **parameters: str) -> Path:
    """A copy of the model repository holding qwen_image with `parameters` (and, if given, the
    `instance_group` line) overridden."""
    target = root / "qwen_image"
    shutil.copytree(MODEL_DIR, target, ignore=shutil.ignore_patterns("__pycache__"))
    config = target / "config.pbtxt"
    text = config.read_text()
    if instance_group:
        text, found = re.subn(r"^instance_group .*$", lambda _: instance_group, text, flags=re.M)
        assert found == 1, "config.pbtxt has no one-line instance_group"
    for key, value in parameters.items():
        text = set_parameter(text, key, str(value))
    config.write_text(text)
    return root


def model_path(request) -> str:
    return os.environ.get("DIFFUSION_MODEL_PATH") or str(request.getfixturevalue("tiny_qwen_dir"))


def default_model_path() -> str:
    """model_path's answer without a fixture (for a server started before its first test)."""
    from engine_lib.pipelines.tiny_models import ensure_model  # noqa: PLC0415

    return os.environ.get("DIFFUSION_MODEL_PATH") or str(ensure_model("qwen_image", "tiny"))


def client_threads() -> set:
    """This process's gRPC client threads (tritonclient stream handlers, grpc's request iterators)."""
    def is_client(thread) -> bool:
        module = getattr(getattr(thread, "_target", None), "__module__", "") or ""
        return module.startswith(("grpc", "tritonclient"))
    return {t for t in threading.enumerate() if is_client(t)}


class LeakProbe:
    """What Triton's own QA checks after a server stops: no process of its group, no shared-memory
    region of its own prefix in /dev/shm (left by a server that exited cleanly), and no gRPC client
    thread the tests started against it still alive in this process."""

    def __init__(self, server: TritonServer):
        self.server = server
        self.threads = client_threads()

    def check(self, code) -> None:
        pid = self.server.process.pid if self.server.process else None
        if pid is not None:
            left = subprocess.run(["pgrep", "-g", str(pid)], capture_output=True, text=True).stdout.split()
            assert left == [], f"processes of the server's group left behind: {left}"
        if code == 0:  # a killed server cannot clean up after itself; the launcher removes what it left
            assert self.server.leaked_shm == [], f"shared memory left behind: {self.server.leaked_shm}"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not client_threads() <= self.threads:
            time.sleep(0.05)
        extra = client_threads() - self.threads
        assert not extra, f"client threads left behind: {[(t.name, getattr(t, '_target', None)) for t in extra]}"


class ProbedServer(TritonServer):
    """A TritonServer whose cleanup checks for leaks; `budget` is its engine's tick budget, if it has one."""

    budget = None

    def start(self, timeout_s: float = 300.0, wait: bool = True) -> "ProbedServer":
        super().start(timeout_s, wait)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until it is ready; the probe's baseline is taken then, when its tests begin (a server started
        early, tests/helpers/early_servers.py, is ready long after its start, while other modules' tests run)."""
        super().wait_ready(timeout_s)
        self.probe = LeakProbe(self)

    def cleanup(self) -> None:
        if self.budget is not None:
            self.budget.release()
        code = self.stop()
        super().cleanup()
        if getattr(self, "probe", None) is not None:
            self.probe.check(code)


def start_server(tmp_dir: Path, model_path: str, exit_timeout_s: int = 30, extra_args=(), instance_group: str = "",
                 fail_prompt: str = "", nan_prompt: str = "", wait: bool = True, **parameters: str) -> ProbedServer:
    """Serve the qwen_image entry with `parameters` overridden; its tick budget file is `server.budget`
    (absent until a test holds the engine); a batch holding `fail_prompt` fails its forward, and a request
    with `nan_prompt` gets NaN latents before each of its steps."""
    budget = TickBudget(tmp_dir / "tick_budget")
    repo = write_repository(tmp_dir / "repository", instance_group, model_path=model_path, **parameters)
    prompts = {"fail_prompt": fail_prompt, "nan_prompt": nan_prompt}
    hooks = {"tick_budget_path": str(budget.path), **{key: value for key, value in prompts.items() if value}}
    server = ProbedServer(
        repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), address="127.0.0.1",
        log_path=tmp_dir / "tritonserver.log", exit_timeout_s=exit_timeout_s, extra_args=extra_args,
        env={**hooks_environment(qwen_image=hooks), "DIFFUSION_PRIORITY_KEY": SERVER_PRIORITY_KEY},
    )
    server.budget = budget
    return server.start(timeout_s=300, wait=wait)


def module_server(directory: str, **options):
    """A module-scoped fixture: `start_server(<a new tmp directory>, the tiny model, **options)`, started while the
    tests before its module run (tests/helpers/early_servers.py), stopped after its module."""
    return module_server_of(lambda tmp_path_factory: start_server(
        tmp_path_factory.mktemp(directory), default_model_path(), wait=False, **options))


def module_server_of(start):
    """module_server for a server that `start(tmp_path_factory)` starts (start_server with wait=False)."""
    @pytest.fixture(scope="module")
    @starts_early(start, ahead=True)
    def fixture(tmp_path_factory):
        yield from serve_early(start, tmp_path_factory)
    return fixture
