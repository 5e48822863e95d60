"""Start and stop the local `tritonserver` from the nvidia-pytriton wheel.

The wheel ships the server binary, the Python backend and one backend stub per
Python version, but not in the layout `tritonserver` expects. `TritonServer`
lays out a backend directory (python/ = libtriton_python.so, the utils module
and the stub matching this interpreter), starts the server in its own process
group on the given ports, waits for /v2/health/ready, and stops it with a
bounded SIGTERM -> SIGKILL of the whole group: tritonserver 2.51 can hang on
exit while a client holds a gRPC stream (docs/serving.md, Shutdown, drain, grace period).

With an `admin_key`, the server loads its models in explicit mode behind a
repository API that needs that key, and `stop()` first unloads every model (new
requests are refused, running ones send their finals, finalize() runs), then ends
the server: tritonserver 2.51 otherwise spends its whole exit timeout waiting for
idle HTTP keep-alive connections and then exits without unloading anything.

`OpenAIFrontDoor` runs the front door (engine_lib/serving/openai_api: the OpenAI
Images API and strict generate endpoints) as a second process next to it, and `GrpcGate`
the gRPC gate (grpc_gate.py), the public gRPC port in front of tritonserver's own, which
refuses oversized messages before tritonserver reads them.

CLI (for `make serve` and the Docker image): `python -m engine_lib.serving.launcher serve`
starts both under a `Supervisor` (supervisor.py) that restarts a server or stub that dies, or a server that
stops answering; a gate or front door that exits on its own is started again alone. `... launcher ready` is
the probes' readiness: exit 0 only while every port serves (`unready_ports`).
Environment: TRITON_ADDRESS (127.0.0.1; 0.0.0.0: the gRPC, metrics and front door ports listen on every
interface), TRITON_HTTP_ADDRESS (tritonserver's HTTP port, which one request can crash: 127.0.0.1 whatever
TRITON_ADDRESS says), HTTP_PORT, GRPC_PORT, METRICS_PORT (8000, 8001, 8002), GRPC_MAX_MESSAGE_BYTES (the
gate's limit on a gRPC message, 16 MiB; 0: no gate, tritonserver's gRPC port is the public one; with the
gate tritonserver's own listens on 127.0.0.1, on a free port), GRPC_MAX_UNSENT_BYTES (the gate's bound on
what one stream holds for a client that reads slowly, 8 MiB), OPENAI_PORT (9000; 0: no front door),
OPENAI_API_KEY (a bearer key the front door asks for), OPENAI_PRIORITY_KEYS (front door bearer keys that
may ask for priority up to a level: `key=1,key2=2`), DIFFUSION_PRIORITY_KEY (the request parameter
`priority_key` a request needs to ask for a priority more urgent than the model's default; default: a
random one per launch; the models and the front door get it in their environment), MODEL_REPOSITORY
(<repo>/model_repository), EXIT_TIMEOUT_SECS (30: the models' unload; the gate's drain 5 s less),
TRITON_ADMIN_KEY (the repository API's key; default: a random one per launch), TRITONSERVER (a
tritonserver binary to use instead of the nvidia-pytriton wheel's, e.g. /opt/tritonserver/bin/tritonserver
in NGC images), MODELS (the models loaded at start: names of the repository's models separated by commas,
or `all`; default qwen_image; `--load-model` takes precedence).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
# Shared memory between tritonserver and each Python stub: one 1024x1024 RGB image
# is 3 MiB, a response of 4 is 12 MiB; start at 64 MiB and grow in 64 MiB steps.
DEFAULT_SHM_BYTES = 64 * 1024 * 1024
DEFAULT_ADDRESS = "127.0.0.1"  # loopback unless told otherwise: nothing is exposed by default
# With an admin key, the models are drained by unloading them before SIGTERM; what is left after it is only
# tritonserver's wait for idle HTTP keep-alive connections, cut this long after the SIGTERM (a SIGKILL: nothing
# of the models is left to lose). tritonserver's own exit timeout stays EXIT_TIMEOUT_SECS: a SIGTERM that
# reaches it from outside (an operator, systemd's control-group kill) must leave the gate's drain time to end
# the running requests, or it tears the stubs down under them and crashes.
DRAINED_EXIT_TIMEOUT_S = 3
# The gRPC gate's drain ends this long before the unload's wait does: the models' requests it ends are
# cancelled, and the models unload, within it.
GATE_DRAIN_MARGIN_S = 5.0
LOADED_LINE = re.compile(rb"successfully loaded '([^']+)'")  # tritonserver's log line once a model is loaded
SIGNAL_LINE = re.compile(rb"^Signal \((\d+)\) received\.")  # ... once a signal starts its shutdown
EXIT_TIMEOUT_LINE = b"Exit timeout expired"  # ... once it gives up waiting for running requests (it crashes next)
INSTANCE_LINE = re.compile(rb"TRITONBACKEND_ModelInstanceInitialize: (\S+) ")  # ... as a Python stub starts
ADMIN_HEADER = "admin-key"  # HTTP header; gRPC clients send it as "triton-grpc-protocol-admin-key"
# Triton's admin-like protocols, closed to clients without the admin key (HTTP and gRPC). shared-memory
# (system and CUDA) would let a client register any /dev/shm region, a Python stub's own included, as an
# output buffer and have inference overwrite it; the others load and unload models, read statistics, and
# change trace and log settings. health, metadata, inference and model-config stay open for clients.
RESTRICTED_PROTOCOLS = ("shared-memory", "model-repository", "statistics", "trace", "logging")
PRIORITY_KEY_ENV = "DIFFUSION_PRIORITY_KEY"  # the key of priorities above a model's default (serve())
MODELS_ENV = "MODELS"  # the models `make serve` and `make demo` load at start (select_models)
DEFAULT_MODELS = ("qwen_image",)  # one model: the server is ready in seconds; MODELS=all loads every one


class TritonServerError(RuntimeError):
    """tritonserver could not be found, did not start, or exited early (message has the log tail)."""


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def default_address() -> str:
    return os.environ.get("TRITON_ADDRESS", "").strip() or DEFAULT_ADDRESS


def default_http_address() -> str:
    """tritonserver's HTTP address: TRITON_HTTP_ADDRESS, else loopback whatever TRITON_ADDRESS says. One
    request can crash that port (a deeply nested JSON body: SIGSEGV, every model restarts) or have its
    integers wrapped; clients belong on the front door, and only an operator who puts a body-size-capping
    proxy in front of it opts in."""
    return os.environ.get("TRITON_HTTP_ADDRESS", "").strip() or DEFAULT_ADDRESS


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as sock:
        sock.bind((DEFAULT_ADDRESS, 0))
        return sock.getsockname()[1]


def connect_host(address: str) -> str:
    """Where to connect to a port that listens on `address` (every interface: loopback)."""
    return "127.0.0.1" if address in ("0.0.0.0", "") else address


def repository_models(repository: os.PathLike | str) -> list[str]:
    """The models of a model repository: its folders that hold a config.pbtxt, sorted."""
    return sorted(p.parent.name for p in Path(repository).glob("*/config.pbtxt"))


def select_models(value: Optional[str | Sequence[str]], repository: os.PathLike | str) -> list[str]:
    """The models to load at start, as `load_models` takes them.

    `value`: names separated by commas or spaces (or a list of such strings), as MODELS or
    `--load-model` give them; `all` (or `*`): every model of the repository (["*"]); empty or
    None: DEFAULT_MODELS. A name that is not a model of `repository` raises TritonServerError
    naming the known ones.
    """
    parts = [value] if isinstance(value, str) or value is None else list(value)
    names = list(dict.fromkeys(n for part in parts for n in (part or "").replace(",", " ").split()))
    if not names:
        names = list(DEFAULT_MODELS)
    if any(n.lower() in ("all", "*") for n in names):
        return ["*"]
    known = repository_models(repository)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise TritonServerError(
            f"unknown model{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} in {repository}; "
            f"known: {', '.join(known) or '(none)'}, or all")
    return names


def system_tritonserver() -> Optional[Path]:
    """$TRITONSERVER, a tritonserver binary with its backends in ../backends (NGC images); None: use the wheel."""
    value = os.environ.get("TRITONSERVER", "").strip()
    return Path(value) if value else None


def find_pytriton_dist() -> Path:
    """The `pytriton/tritonserver` directory of the installed nvidia-pytriton wheel."""
    try:
        import pytriton  # noqa: PLC0415 (optional dependency, only the launcher needs it)
    except ImportError as exc:
        raise TritonServerError("nvidia-pytriton is not installed; run `bash scripts/setup.sh`") from exc
    dist = Path(pytriton.__file__).resolve().parent / "tritonserver"
    if not (dist / "bin" / "tritonserver").is_file():
        raise TritonServerError(f"no tritonserver binary under {dist}")
    return dist


def prepare_backend_dir(target: Path, dist: Optional[Path] = None) -> Path:
    """Lay out `target/python/` as the Python backend for this interpreter's version; returns target."""
    dist = dist or find_pytriton_dist()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise TritonServerError(f"the nvidia-pytriton wheel has no Python backend stub for Python {version}")
    python_dir = target / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(dist / "backends" / "python" / name, python_dir / name)
    shutil.copy2(stub, python_dir / "triton_python_backend_stub")
    return target


def python_shared_libdir() -> Optional[str]:
    """The directory of this interpreter's shared libpython, if it was built with one."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return None
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    soname = sysconfig.get_config_var("INSTSONAME") or ""
    return libdir if soname and (Path(libdir) / soname).exists() else None


def server_env(dist: Path, base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """Environment for tritonserver: the wheel's libraries, this venv's Python first on PATH."""
    env = dict(os.environ if base is None else base)
    libs = [str(dist.parent.parent / "nvidia_pytriton.libs")]
    # The stub links libpython<maj.min>.so; it must be this interpreter's, not a system one of another
    # patch level, or compiled stdlib modules (_ssl, ...) fail with undefined symbols.
    libpython_dir = python_shared_libdir()
    if libpython_dir:
        libs.insert(0, libpython_dir)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (*libs, env.get("LD_LIBRARY_PATH", "")) if p)
    # The stub embeds Python and takes its prefix from the first `python3` on PATH.
    env["PATH"] = os.pathsep.join(p for p in (str(Path(sys.prefix) / "bin"), env.get("PATH", "")) if p)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class TritonServer:
    """One local tritonserver process; a context manager that starts it ready and always stops it.

    ```
    with TritonServer(model_repository=repo, http_port=p1, grpc_port=p2, metrics_port=p3) as server:
        tritonclient.grpc.InferenceServerClient(server.grpc_url) ...
    ```
    """

    def __init__(
        self,
        model_repository: Optional[os.PathLike | str] = None,
        *,
        http_port: Optional[int] = None,
        grpc_port: Optional[int] = None,
        metrics_port: Optional[int] = None,
        address: Optional[str] = None,
        log_path: Optional[os.PathLike | str] = None,
        shm_bytes: int = DEFAULT_SHM_BYTES,
        exit_timeout_s: Optional[int] = None,
        log_verbose: int = 0,
        extra_args: Sequence[str] = (),
        env: Optional[Mapping[str, str]] = None,
        admin_key: Optional[str] = None,
        load_models: Sequence[str] = ("*",),
        http_address: Optional[str] = None,
        grpc_address: Optional[str] = None,
    ):
        self.model_repository = Path(
            model_repository or os.environ.get("MODEL_REPOSITORY") or DEFAULT_MODEL_REPOSITORY
        ).resolve()
        self.http_port = http_port or _env_int("HTTP_PORT", 8000)
        self.grpc_port = grpc_port or _env_int("GRPC_PORT", 8001)
        self.metrics_port = metrics_port or _env_int("METRICS_PORT", 8002)
        self.address = address or default_address()  # metrics (and gRPC and HTTP unless given)
        self.http_address = http_address or default_http_address()
        self.grpc_address = grpc_address or self.address
        self.admin_key = admin_key
        self.load_models = list(load_models)  # with an admin key: the models loaded at start ("*": all)
        self.unloaded_cleanly: Optional[bool] = None  # set by stop(): every model unloaded before the exit
        self.shm_bytes = shm_bytes
        self.exit_timeout_s = exit_timeout_s if exit_timeout_s is not None else _env_int("EXIT_TIMEOUT_SECS", 30)
        self.log_verbose = log_verbose
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self._workdir = Path(tempfile.mkdtemp(prefix="tritonserver-"))
        self.log_path = Path(log_path) if log_path else self._workdir / "tritonserver.log"
        # Unique per server: two servers on one host must not share shm region names.
        self.shm_prefix = f"dtriton{os.getpid()}-{uuid.uuid4().hex[:8]}-"
        self.leaked_shm: list[str] = []  # regions the stopped server left in /dev/shm (removed by stop())
        self.process: Optional[subprocess.Popen] = None
        self._reaper: Optional[subprocess.Popen] = None  # cleans up if we die without stop() (start_reaper)
        self._log_file = None
        self._log_copy: Optional[threading.Thread] = None  # copies the server's output to the log (_copy_log)
        self._started = 0.0  # time.monotonic() at start()
        # Written by the log copy's thread only, the set replaced whole (never changed in place): no lock needed.
        self.loaded_models: frozenset[str] = frozenset()  # the models its log says loaded
        self.instances: frozenset[str] = frozenset()  # the model instances (Python stubs) its log says it started
        self.load_failed = False  # its log says a model failed to load
        self.signalled: Optional[int] = None  # the signal its log says started its shutdown (ours or not)
        self.exit_timed_out = False  # its log says its exit timeout expired with requests still running
        self.signalled_here = False  # the launcher sent it a signal (send_signal, stop)
        self.was_ready = False  # it was ready once (check_ready)

    # -- addresses ---------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"{connect_host(self.http_address)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{connect_host(self.grpc_address)}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{connect_host(self.address)}:{self.metrics_port}/metrics"

    # -- lifecycle -----------------------------------------------------------------
    def command(self, backend_dir: Path) -> list[str]:
        binary = system_tritonserver() or find_pytriton_dist() / "bin" / "tritonserver"
        args = [
            str(binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backend_dir}",
            f"--http-address={self.http_address}",
            f"--grpc-address={self.grpc_address}",
            f"--metrics-address={self.address}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            "--allow-gpu-metrics=false",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--log-verbose={self.log_verbose}",
            f"--backend-config=python,shm-default-byte-size={self.shm_bytes}",
            f"--backend-config=python,shm-growth-byte-size={self.shm_bytes}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]
        if self.admin_key:
            restricted = f"{','.join(RESTRICTED_PROTOCOLS)}:{ADMIN_HEADER}={self.admin_key}"
            args += ["--model-control-mode=explicit", *(f"--load-model={m}" for m in self.load_models),
                     f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}"]
        return args + self.extra_args

    def start(self, timeout_s: float = 300.0, wait: bool = True) -> "TritonServer":
        """Start the server and wait until /v2/health/ready (every model loaded); without `wait`, return once it
        runs (`check_ready` then says when it is ready: the supervisor watches its stubs meanwhile)."""
        assert self.process is None, "server already started"
        system = system_tritonserver()
        if system is not None:  # an NGC image: its own backends and libraries
            backend_dir, env = system.parent.parent / "backends", dict(os.environ)
        else:
            dist = find_pytriton_dist()
            backend_dir = prepare_backend_dir(self._workdir / "backends", dist)
            env = server_env(dist)
        env.update(self.extra_env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            self.command(backend_dir), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,  # own process group: stubs die with it
            preexec_fn=die_with_parent,
        )
        self._started = time.monotonic()
        self._log_copy = threading.Thread(target=self._copy_log, name="tritonserver log", daemon=True)
        self._log_copy.start()
        try:
            self._reaper = start_reaper(self.process.pid, self.shm_prefix)
            if self.admin_key:
                hide_argument(self.process, self.admin_key)
            if wait:
                self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout_s: float) -> None:
        while not self.check_ready(timeout_s):
            time.sleep(0.25)

    def check_ready(self, timeout_s: float) -> bool:
        """Whether the started server is ready (its shm regions then become 0600); TritonServerError if it
        exited first, or is still not ready `timeout_s` after its start."""
        if self.process.poll() is not None:
            raise TritonServerError(f"tritonserver exited with code {self.process.returncode} before it was ready; "
                                    f"log tail ({self.log_path}):\n{self.log_tail()}")
        if self.is_ready():
            self._restrict_shm_regions()
            self.was_ready = True
            return True
        if time.monotonic() - self._started >= timeout_s:
            raise TritonServerError(f"tritonserver not ready after {timeout_s:.0f} s; log tail:\n{self.log_tail()}")
        return False

    def _copy_log(self) -> None:
        """Copy the server's output (its stubs' too) to the log, noting the instances it starts and the models it
        says loaded or failed to load: the supervisor must know which models loaded before the ports open (only
        once every one has)."""
        with self.process.stdout as output:
            for line in output:
                loaded, instance, signalled = LOADED_LINE.search(line), INSTANCE_LINE.search(line), SIGNAL_LINE.match(line)
                if signalled:
                    self.signalled = int(signalled.group(1))
                elif EXIT_TIMEOUT_LINE in line:
                    self.exit_timed_out = True
                elif loaded:
                    self.loaded_models = self.loaded_models | {loaded.group(1).decode(errors="replace")}
                elif instance:
                    self.instances = self.instances | {instance.group(1).decode(errors="replace")}
                elif b"failed to load '" in line:
                    self.load_failed = True
                try:
                    self._log_file.write(line)
                    self._log_file.flush()
                except (OSError, ValueError, AttributeError):
                    pass  # no log to write to (a closed console, or stop() gave up waiting): read on all the same,
                    # or the server would block on a full pipe

    def is_ready(self) -> bool:
        """Every model loaded, and the metrics port answering (it starts a little after the HTTP
        service: a scrape right after /v2/health/ready turned 200 was refused, seen here)."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as reply:
                if reply.status != 200:
                    return False
            with urllib.request.urlopen(self.metrics_url, timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def is_live(self) -> bool:
        """Its HTTP service answers /v2/health/live (a server that is stopped, or stuck, does not)."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/live", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def stopping_on_its_own(self) -> bool:
        """A signal from outside the launcher (an operator's, systemd's) started the server's shutdown."""
        return self.signalled is not None and not self.signalled_here

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        """Signal the server process only (e.g. SIGTERM to test a drain); `stop()` still bounds the exit."""
        if self.is_running():
            self.signalled_here = True
            self.process.send_signal(sig)

    def wait(self, timeout_s: float) -> Optional[int]:
        """Wait up to timeout_s for the server to exit; returns its exit code, or None if still running."""
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    # -- the repository API (only with an admin key) ------------------------------------
    def _repository(self, path: str, timeout_s: float = 10.0) -> Any:
        request = urllib.request.Request(f"http://{self.http_url}/v2/repository/{path}", data=b"{}", method="POST",
                                         headers={ADMIN_HEADER: self.admin_key or ""})
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            body = reply.read()
        return json.loads(body) if body else None

    def model_states(self) -> dict[str, str]:
        """Each model of the repository and its state (READY, UNLOADING, UNAVAILABLE, ...)."""
        return {m["name"]: m.get("state", "") for m in self._repository("index")}

    def unload_all(self, timeout_s: float) -> list[str]:
        """Unload every model (Triton refuses their new requests at once; running ones finish) and wait
        up to timeout_s for each to be unloaded; returns the models still loaded (empty: all done)."""
        deadline = time.monotonic() + timeout_s
        try:
            for name, state in self.model_states().items():
                if state == "READY":
                    self._repository(f"models/{name}/unload")
            while True:
                left = sorted(n for n, state in self.model_states().items() if state not in ("UNAVAILABLE", ""))
                if not left or time.monotonic() >= deadline:
                    return left
                time.sleep(0.1)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            if self.signalled is None:
                return [f"(repository API unreachable: {exc})"]
            # A signal from outside stops the server meanwhile (it unloads the models itself): its exit says how.
            self.wait(max(0.0, deadline - time.monotonic()) + 5.0)
            return [] if self.exited_cleanly() else ["(tritonserver's own stop did not end cleanly)"]

    def exited_cleanly(self) -> bool:
        """It exited with code 0, its running requests ended before its exit timeout expired."""
        return self.process is not None and self.process.poll() == 0 and not self.exit_timed_out

    def stub_pids(self) -> dict[int, str]:
        """The server's live Python-backend stubs: pid -> model instance name (e.g. qwen_image_0_0). A zombie
        (a killed stub tritonserver has not reaped) has no command line: left out, as dead."""
        stubs = {}
        if not self.is_running():
            return stubs
        for status in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(proc_stat(status.parent.name)[1]) != self.process.pid:
                    continue
                argv = (status.parent / "cmdline").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            if argv and argv[0].endswith(b"triton_python_backend_stub") and len(argv) > 8:
                stubs[int(status.parent.name)] = argv[8].decode(errors="replace")
        return stubs

    def stop(self, grace_s: Optional[float] = None, drain: bool = True) -> Optional[int]:
        """End the server within a bounded time; idempotent.

        With an admin key and `drain`, first unload every model of a ready server (up to the exit timeout);
        then SIGTERM the server, wait up to grace_s, and SIGKILL whatever is left of its process group.
        By default grace_s is 15 s; DRAINED_EXIT_TIMEOUT_S once the models unloaded; and, for a server
        whose shutdown a signal from outside started (it is waited for, not signalled again), its exit
        timeout and 5 s, in which the gate's drain ends its running requests. With `drain`,
        `unloaded_cleanly` says whether every model unloaded (or the server exited cleanly on its own).
        """
        process = self.process
        if process is None:
            return None
        if grace_s is None:
            grace_s = self.exit_timeout_s + 5.0 if self.stopping_on_its_own else 15.0
        if drain and self.admin_key and process.poll() is None and self.signalled is None and self.is_ready():
            left = self.unload_all(self.exit_timeout_s)
            self.unloaded_cleanly = not left
            if left:
                print(f"launcher: still loaded after {self.exit_timeout_s} s: {', '.join(left)}", flush=True)
            grace_s = DRAINED_EXIT_TIMEOUT_S if not left else DRAINED_EXIT_TIMEOUT_S + 5.0
        if process.poll() is None:
            if self.signalled is None:
                self.signalled_here = True
                _signal_group(process.pid, signal.SIGTERM, only_leader=True)
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        if drain and self.was_ready and self.unloaded_cleanly is None:
            self.unloaded_cleanly = self.exited_cleanly()
        # Whatever is left in the group (the server after the grace period, orphaned stubs) is killed.
        _signal_group(process.pid, signal.SIGKILL)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        _wait_group_gone(process.pid, timeout_s=5.0)
        release_reaper(self._reaper)
        self._reaper = None
        if self._log_copy is not None:
            self._log_copy.join(timeout=5)  # the group is gone: the output's end is near
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        self._remove_shm_regions()
        shutil.rmtree(self._workdir / "backends", ignore_errors=True)
        try:
            self._workdir.rmdir()  # empty unless it holds the default log
        except OSError:
            pass
        return process.returncode

    def _restrict_shm_regions(self) -> None:
        """Make the Python backend's shm regions readable by their owner only. tritonserver creates them
        0644 (whatever the umask), so every user of the host could read the prompts and images passing
        through; the stubs and the server run as one user and keep their access. A model loaded later
        (repository API) keeps 0644 until the next start."""
        for path in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            try:
                path.chmod(0o600)
            except OSError:
                pass  # gone meanwhile

    def _remove_shm_regions(self) -> None:
        """A killed server leaves its Python-backend shm regions in /dev/shm; remove ours (and say which)."""
        shm = Path("/dev/shm")
        if shm.is_dir():
            for path in shm.glob(f"{self.shm_prefix}*"):
                self.leaked_shm.append(path.name)
                path.unlink(missing_ok=True)

    def cleanup(self) -> None:
        """Stop the server and remove its work directory (a log given by `log_path` elsewhere stays)."""
        self.stop()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def __enter__(self) -> "TritonServer":
        if self.process is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()


class OpenAIFrontDoor:
    """The OpenAI front door (`python -m engine_lib.serving.openai_api`) as a child process.

    `start()` waits until its /health answers; a process that exits first, or a timeout,
    raises TritonServerError with its output's tail. `stop()` is bounded (SIGTERM, then SIGKILL).
    """

    def __init__(self, triton_grpc_url: str, host: str = "127.0.0.1", port: Optional[int] = None,
                 log_path: Optional[os.PathLike | str] = None, env: Optional[Mapping[str, str]] = None,
                 drain_s: float = 5.0):
        self.triton_grpc_url = triton_grpc_url
        self.drain_s = drain_s  # at SIGTERM, how long its running requests may still take
        self.host = host
        self.port = port if port is not None else _env_int("OPENAI_PORT", 9000)
        self.log_path = Path(log_path) if log_path else None  # None: the launcher's console
        self.env = dict(os.environ if env is None else env)
        self.process: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://{connect_host(self.host)}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "OpenAIFrontDoor":
        env = dict(self.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        command = [sys.executable, "-m", "engine_lib.serving.openai_api", "--triton", self.triton_grpc_url,
                   "--host", self.host, "--port", str(self.port), f"--drain-s={self.drain_s:g}"]
        self.process = spawn(command, env, self.log_path)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise TritonServerError(f"the OpenAI front door exited with code {self.process.returncode} on port "
                                        f"{self.port}; its output:\n{self.log_tail()}")
            try:  # any answer: it serves (its /health says 503 while tritonserver is not ready, after a restart)
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return self
            except urllib.error.HTTPError:
                return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        self.stop()
        raise TritonServerError(f"the OpenAI front door did not answer on port {self.port} within {timeout_s:.0f} s; "
                                f"its output:\n{self.log_tail()}")

    def stop(self, grace_s: float = 10.0) -> Optional[int]:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        return self.process.returncode

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None:
            return "(on the console above)"
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


class GrpcGate:
    """The gRPC gate (grpc_gate.py) as a child process: the public gRPC port, which refuses a message over
    `max_message_bytes` before tritonserver (on loopback, at `upstream`) sees it and forwards the rest.

    Like the front door it lives as long as the launcher; a restarted server comes back at the same
    `upstream`. `start()` waits until its port accepts connections; a process that exits first, or a
    timeout, raises TritonServerError with its output's tail. `drain()` starts its stop (SIGTERM: it ends
    every client stream, requests still open after `drain_s` with UNAVAILABLE) and returns at once;
    `stop()` is bounded (SIGTERM, then SIGKILL).
    """

    def __init__(self, upstream: str, host: str, port: int, max_message_bytes: int,
                 log_path: Optional[os.PathLike | str] = None, env: Optional[Mapping[str, str]] = None,
                 drain_s: float = 25.0):
        self.upstream = upstream
        self.host = host
        self.port = port
        self.max_message_bytes = max_message_bytes
        self.drain_s = drain_s
        self.log_path = Path(log_path) if log_path else None  # None: the launcher's console
        self.env = dict(os.environ if env is None else env)
        self.process: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"{connect_host(self.host)}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "GrpcGate":
        from engine_lib.serving.grpc_gate import MAX_MESSAGE_ENV, READY_FD_ENV  # noqa: PLC0415 (imports grpc)

        # The gate says it listens on a pipe: a connection to the port could reach whoever else holds it.
        ready_read, ready_write = os.pipe()
        env = {**self.env, MAX_MESSAGE_ENV: str(self.max_message_bytes), READY_FD_ENV: str(ready_write)}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        try:
            try:
                self.process = spawn([sys.executable, "-m", "engine_lib.serving.grpc_gate", "--listen",
                                      f"{self.host}:{self.port}", "--upstream", self.upstream,
                                      f"--drain-s={self.drain_s:g}"], env, self.log_path, pass_fds=(ready_write,))
            finally:
                os.close(ready_write)  # ours: only the gate's copy may keep the pipe open
            ready = select.select([ready_read], [], [], timeout_s)[0] and os.read(ready_read, 16) == b"ready"
        finally:
            os.close(ready_read)
        if ready:
            return self
        try:
            self.process.wait(timeout=5)  # it closed the pipe without a word: it is exiting
        except subprocess.TimeoutExpired:
            self.stop()
            raise TritonServerError(f"the gRPC gate did not listen on port {self.port} within {timeout_s:.0f} s; "
                                    f"its output:\n{self.log_tail()}") from None
        raise TritonServerError(f"the gRPC gate exited with code {self.process.returncode} on port {self.port}; "
                                f"its output:\n{self.log_tail()}")

    def drain(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    def end_requests(self) -> None:
        """tritonserver is shutting down on its own: the gate ends the streams open now (each request gets its
        final, or UNAVAILABLE after the drain) and serves on (SIGUSR1)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGUSR1)

    stop = OpenAIFrontDoor.stop  # the same bounded stop and log tail as the front door's
    log_tail = OpenAIFrontDoor.log_tail


def spawn(command: Sequence[str], env: Mapping[str, str], log_path: Optional[Path],
          pass_fds: Sequence[int] = ()) -> subprocess.Popen:
    """A child of the launcher (front door, gate) that dies with it, its output appended to `log_path`
    (None: the console)."""
    if log_path is None:
        return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent,
                                pass_fds=pass_fds)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=die_with_parent, pass_fds=pass_fds)


def proc_stat(pid: int | str) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces): [0] the state, [1] the
    parent's pid, [11] and [12] user and system CPU ticks. OSError once the process is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def hide_argument(process: subprocess.Popen, secret: str, timeout_s: float = 10.0) -> None:
    """Overwrite `secret` with '*'s in a child's command line, so that ps and /proc/<pid>/cmdline stop showing it.

    tritonserver 2.51 takes its restricted-API keys on its command line only (no environment variable or
    file), which any user of the host can read. It parses its options into strings of its own in main(),
    before it starts a thread (`tritonserver --help` parses and exits without one), so once it has a
    second thread its argv area is not read again and is overwritten here through /proc/<pid>/mem (a
    parent may write its child's memory, also under Yama ptrace_scope 1). Until then (20-30 ms measured) the
    key is visible. A failed write is logged and the server serves on. perf_analyzer, which takes the key
    as a header argument, parses its options before its first thread too.
    """
    deadline = time.monotonic() + timeout_s
    try:
        while len(os.listdir(f"/proc/{process.pid}/task")) < 2 and time.monotonic() < deadline:
            if process.poll() is not None:
                return  # exited at once: wait_ready reports it
            time.sleep(0.01)
        start, end = (int(field) for field in proc_stat(process.pid)[45:47])  # arg_start, arg_end (fields 48, 49)
        memory = os.open(f"/proc/{process.pid}/mem", os.O_RDWR)
        try:
            argv = os.pread(memory, end - start, start)
            os.pwrite(memory, argv.replace(secret.encode(), b"*" * len(secret.encode())), start)
        finally:
            os.close(memory)
    except OSError as exc:
        print(f"launcher: the admin key stays visible in the command line of pid {process.pid}: {exc}", flush=True)


def die_with_parent() -> None:
    """Run in a child before exec: the kernel SIGKILLs it when the thread that started it exits
    (PR_SET_PDEATHSIG), so a launcher or test run killed with SIGKILL leaves no server behind.
    Start servers from a thread that outlives them (the main thread does)."""
    import ctypes  # noqa: PLC0415

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


# The reaper's program: it waits for its stdin to close. `release_reaper` writes a word first; a bare EOF
# means the process that started the server died without stopping it.
_REAPER = """
import os, signal, sys
from pathlib import Path
if not sys.stdin.buffer.read():
    try:
        os.killpg(int(sys.argv[1]), signal.SIGKILL)
    except OSError:
        pass
    for path in Path("/dev/shm").glob(sys.argv[2] + "*"):
        path.unlink(missing_ok=True)
"""


_REAPER_PIPES: set[int] = set()  # the write ends (fds) of our live reapers' pipes


def _close_reaper_pipes_in_child() -> None:
    """After os.fork (multiprocessing's fork, say): the child must not hold our reapers' pipes, or our
    death would not be EOF to them until the child exits too. Each fd becomes /dev/null in the child
    (dup2: the file objects stay valid and no lock is taken); exec'd children never get the pipes,
    Python's pipes are not inheritable."""
    for fd in _REAPER_PIPES:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    _REAPER_PIPES.clear()


os.register_at_fork(after_in_child=_close_reaper_pipes_in_child)


def start_reaper(group: int, shm_prefix: str) -> subprocess.Popen:
    """A small process, in its own session, that SIGKILLs process group `group` (a server and its
    stubs) and removes its shared memory if we die, even by SIGKILL, without `release_reaper`: its
    stdin is a pipe only we hold, so our death is EOF to it. `die_with_parent` ends the server
    itself, but a stub can hang once its server is gone and live on holding its memory (seen with
    tritonserver 2.51: its parent-death handler blocked on a mutex while a metrics call waited for
    the dead server's reply)."""
    reaper = subprocess.Popen([sys.executable, "-c", _REAPER, str(group), shm_prefix], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _REAPER_PIPES.add(reaper.stdin.fileno())
    return reaper


def release_reaper(reaper: Optional[subprocess.Popen]) -> None:
    """Tell a reaper that the group was stopped (nothing for it to do) and let it exit."""
    if reaper is None:
        return
    _REAPER_PIPES.discard(reaper.stdin.fileno())
    try:
        reaper.stdin.write(b"stopped")
        reaper.stdin.close()
    except OSError:
        pass  # it is gone already
    try:
        reaper.wait(timeout=5)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()


def _signal_group(pid: int, sig: int, only_leader: bool = False) -> None:
    try:
        if only_leader:
            os.kill(pid, sig)
        else:
            os.killpg(pid, sig)  # start_new_session made the server its group's leader
    except (ProcessLookupError, PermissionError):
        pass


def _wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """Wait (bounded) until no process of the group is left, so callers can reuse its ports and shm."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return True
        time.sleep(0.05)
    return False


def serve(argv: Optional[Sequence[str]] = None) -> int:
    """Run tritonserver (supervised) and the front door in the foreground until Ctrl-C or SIGTERM."""
    from engine_lib.serving.grpc_gate import max_message_bytes  # noqa: PLC0415 (imports grpc)
    from engine_lib.serving.supervisor import RESTARTS_ENV, Supervisor  # noqa: PLC0415 (it imports this module)

    parser = argparse.ArgumentParser(prog="python -m engine_lib.serving.launcher")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="start tritonserver on the model repository and keep it serving")
    p.add_argument("--model-repository", default=None, help="default: $MODEL_REPOSITORY or <repo>/model_repository")
    p.add_argument("--http-port", type=int, default=None, help="default: $HTTP_PORT or 8000")
    p.add_argument("--grpc-port", type=int, default=None, help="default: $GRPC_PORT or 8001")
    p.add_argument("--metrics-port", type=int, default=None, help="default: $METRICS_PORT or 8002")
    p.add_argument("--address", default=None,
                   help="the address the gRPC, metrics and front door ports listen on (tritonserver's HTTP port: "
                        f"$TRITON_HTTP_ADDRESS or {DEFAULT_ADDRESS}); default: $TRITON_ADDRESS or {DEFAULT_ADDRESS}")
    p.add_argument("--log-file", default=None, help="default: the console")
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--load-model", action="append", default=None,
                   help="a model to load at start (repeatable; `all`: every model of the repository); "
                        f"default: ${MODELS_ENV} (names separated by commas, or all) or {','.join(DEFAULT_MODELS)}")
    p.add_argument("--stub-drain", type=float, default=10.0,
                   help="after a stub dies: seconds the other models' running requests get before the restart")
    p.add_argument("--openai-port", type=int, default=None,
                   help="the front door's port (OpenAI Images API, strict generate); default: $OPENAI_PORT or 9000; "
                        "0: none")
    sub.add_parser("ready", help="exit 0 if every port of a running launcher serves (the probes' readiness), "
                                 "else 1 naming those that do not; reads the ports from the environment as serve does")
    args = parser.parse_args(argv)
    if args.command == "ready":
        return _report_ready(unready_ports())
    openai_port = args.openai_port if args.openai_port is not None else _env_int("OPENAI_PORT", 9000)
    address = args.address or default_address()
    repository = args.model_repository or os.environ.get("MODEL_REPOSITORY") or DEFAULT_MODEL_REPOSITORY
    try:
        models = select_models(args.load_model or os.environ.get(MODELS_ENV), repository)
    except TritonServerError as exc:
        print(f"launcher: {exc}", file=sys.stderr, flush=True)
        return 2
    admin_key = os.environ.get("TRITON_ADMIN_KEY", "").strip() or secrets.token_urlsafe(24)
    # The key a request needs to ask for more than the model's default priority. tritonserver (so its
    # stubs) and the front door read it from their environment, never from a command line (ps shows those).
    priority_key = os.environ.get(PRIORITY_KEY_ENV, "").strip() or secrets.token_urlsafe(24)
    try:
        max_message = max_message_bytes()
    except ValueError as exc:
        print(f"launcher: {exc}", file=sys.stderr, flush=True)
        return 2
    grpc_port = args.grpc_port or _env_int("GRPC_PORT", 8001)
    # With the gate, tritonserver's own gRPC port is internal: loopback, on a port chosen once, so that a
    # restarted server comes back where the gate and the front door look for it.
    internal_grpc_port = free_port() if max_message else grpc_port
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    began = [time.monotonic()]  # when the current server was started (each restart starts anew)

    def make_server(restarts: int) -> TritonServer:
        began[0] = time.monotonic()
        return TritonServer(args.model_repository, http_port=args.http_port, grpc_port=internal_grpc_port,
                            metrics_port=args.metrics_port, address=address,
                            grpc_address=DEFAULT_ADDRESS if max_message else address,
                            log_path=args.log_file or "/dev/stdout", log_verbose=args.log_verbose, admin_key=admin_key,
                            env={RESTARTS_ENV: str(restarts), PRIORITY_KEY_ENV: priority_key}, load_models=models)

    # The gate and the front door, each started once for the launcher's life (they reconnect to a restarted
    # server by themselves), and stopped after it.
    children: dict[str, GrpcGate | OpenAIFrontDoor] = {}
    failed = threading.Event()  # one of them could not start again
    stopped = threading.Event()  # they are stopped: the threads that restarted them may end

    def start_once(name: str, child: Callable[[], GrpcGate | OpenAIFrontDoor]) -> bool:
        if name not in children:
            try:
                children[name] = child().start()
            except TritonServerError as exc:
                print(f"launcher: {exc}", file=sys.stderr, flush=True)
                failed.set()
                stop.set()
                return False
            threading.Thread(target=_restart_when_exits, args=(children[name], name, stop, failed, stopped),
                             daemon=True).start()
        return True

    def drain_gate() -> None:
        """At the stop, while the models unload: the gate ends its client streams (idle ones at once), so
        that none keeps tritonserver's unload waiting, and the requests still running after its drain with
        UNAVAILABLE, before the unload's wait (EXIT_TIMEOUT_SECS) runs out."""
        stop.wait()
        if "the gRPC gate" in children:
            children["the gRPC gate"].drain()

    threading.Thread(target=drain_gate, daemon=True).start()
    gate_drain_s = max(1.0, _env_int("EXIT_TIMEOUT_SECS", 30) - GATE_DRAIN_MARGIN_S)

    def on_ready(server: TritonServer) -> None:
        if max_message and not start_once("the gRPC gate", lambda: GrpcGate(
                server.grpc_url, address, grpc_port, max_message, log_path=args.log_file, drain_s=gate_drain_s)):
            return
        grpc_url = children["the gRPC gate"].url if max_message else server.grpc_url
        # The front door's requests go through the gate too: at the stop they get the gate's drain and its
        # UNAVAILABLE final like any client's, instead of holding the models' unload past its timeout.
        front_env = {**os.environ, "TRITON_ADMIN_KEY": admin_key, PRIORITY_KEY_ENV: priority_key}
        if openai_port and not start_once("the front door", lambda: OpenAIFrontDoor(
                grpc_url, host=address, port=openai_port, log_path=args.log_file, env=front_env, drain_s=gate_drain_s)):
            return
        front = f", front door {children['the front door'].url}" if openai_port else ""
        print(f"launcher: ready in {time.monotonic() - began[0]:.1f} s (grpc {grpc_url}, http {server.http_url}"
              f"{front}); Ctrl-C stops", flush=True)

    loading = "every model" if models == ["*"] else ", ".join(models)
    print(f"launcher: starting tritonserver on {repository} (address {address}), loading {loading}", flush=True)
    def on_stopping(server: TritonServer) -> None:
        if "the gRPC gate" in children:
            children["the gRPC gate"].end_requests()

    supervisor = Supervisor(make_server, stop, on_ready=on_ready, start_timeout_s=args.start_timeout,
                            stub_drain_s=args.stub_drain, on_stopping=on_stopping)
    code = supervisor.run()
    for name in ("the front door", "the gRPC gate"):  # after the drain: running requests came through them
        if name in children:
            print(f"launcher: stopping {name}", flush=True)
            children[name].stop()
    stopped.set()
    code = 1 if failed.is_set() else code
    print(f"launcher: stopped (exit code {code})", flush=True)
    return code


def unready_ports(environ: Mapping[str, str] = os.environ, timeout_s: float = 2.0) -> list[str]:
    """The public ports of a launcher started with `environ` that do not serve now (empty: ready).

    tritonserver's own readiness is not enough: it says ready before the gate and the front door listen, while
    one of them restarts, and (its HTTP port on loopback) says nothing about them, nor about a model whose
    parallel worker group is broken (a Python model cannot change it). So: tritonserver's /v2/health/ready,
    its metrics (no model's diffusion_parallel_workers_down at 1), the gate's port taking a connection, and
    the front door's /health, which answers 200 only while tritonserver is ready through the gate.
    """
    from engine_lib.serving.supervisor import LABEL, SAMPLE  # noqa: PLC0415 (it imports this module)

    host = connect_host(environ.get("TRITON_ADDRESS", "").strip() or DEFAULT_ADDRESS)
    http_host = connect_host(environ.get("TRITON_HTTP_ADDRESS", "").strip() or DEFAULT_ADDRESS)
    port = lambda name, default: int(environ.get(name, "").strip() or default)  # noqa: E731
    checks = {f"tritonserver (http://{http_host}:{port('HTTP_PORT', 8000)}/v2/health/ready)":
              f"http://{http_host}:{port('HTTP_PORT', 8000)}/v2/health/ready"}
    if environ.get("GRPC_MAX_MESSAGE_BYTES", "").strip() != "0":
        checks[f"the gRPC gate ({host}:{port('GRPC_PORT', 8001)})"] = (host, port("GRPC_PORT", 8001))
    if port("OPENAI_PORT", 9000):
        checks[f"the front door (http://{host}:{port('OPENAI_PORT', 9000)}/health)"] = \
            f"http://{host}:{port('OPENAI_PORT', 9000)}/health"
    metrics = f"http://{host}:{port('METRICS_PORT', 8002)}/metrics"
    unready = []
    try:
        with urllib.request.urlopen(metrics, timeout=timeout_s) as reply:
            samples = SAMPLE.findall(reply.read().decode(errors="replace"))
        unready += [f"the parallel workers of {dict(LABEL.findall(labels)).get('instance', labels)}"
                    for name, labels, value in samples if name == "diffusion_parallel_workers_down" and float(value)]
    except (urllib.error.URLError, OSError):
        unready.append(f"tritonserver's metrics ({metrics})")
    for name, target in checks.items():
        try:
            if isinstance(target, tuple):
                socket.create_connection(target, timeout=timeout_s).close()
            else:
                with urllib.request.urlopen(target, timeout=timeout_s) as reply:
                    if reply.status != 200:
                        unready.append(name)
        except (urllib.error.URLError, OSError):
            unready.append(name)
    return unready


def _report_ready(unready: list[str]) -> int:
    if unready:
        print(f"not ready: {', '.join(unready)}", flush=True)
        return 1
    print("ready", flush=True)
    return 0


def _restart_when_exits(child: GrpcGate | OpenAIFrontDoor, name: str, stop: threading.Event,
                        failed: threading.Event, stopped: threading.Event) -> None:
    """The front door or the gate exiting on its own (killed, crashed) is started again on its port, as a dead
    stub's server is, while tritonserver and the other child serve on: its clients' connections fail and
    they reconnect (the front door's video jobs are lost with it). While it keeps exiting within a minute
    of its start, each restart waits the supervisor's backoff (1, 2, 4, ... 30 s). One that cannot start
    again ends the launcher (exit code 1). The thread outlives what it started (die_with_parent): it ends once
    `stopped` says the launcher stopped its children."""
    from engine_lib.serving.supervisor import Backoff  # noqa: PLC0415 (it imports this module)

    try:
        _restart_until_stop(child, name, stop, failed, Backoff())
    finally:
        stopped.wait()


def _restart_until_stop(child: GrpcGate | OpenAIFrontDoor, name: str, stop: threading.Event,
                        failed: threading.Event, backoff: Any) -> None:
    backoff.up()
    while not stop.wait(0.5):
        if child.process.poll() is None:
            continue
        print(f"launcher: {name} exited (code {child.process.returncode}); restarting it", flush=True)
        if stop.wait(max(1.0, backoff.failed())):  # a whole-tree stop signals it too: not a death
            return
        try:
            child.start()
        except TritonServerError as exc:
            print(f"launcher: {name} did not start again: {exc}", file=sys.stderr, flush=True)
            failed.set()
            stop.set()
            return
        backoff.up()
        print(f"launcher: {name} restarted ({child.url})", flush=True)


if __name__ == "__main__":
    sys.exit(serve())
