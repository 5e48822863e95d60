"""Start and stop the local `tritonserver` from the nvidia-pytriton wheel (its layout: wheel.py).

`TritonServer` lays out a backend directory (wheel.prepare_backend_dir), starts the server in its own process
group on the given ports, waits for /v2/health/ready, and stops it with a
bounded SIGTERM -> SIGKILL of the whole group: tritonserver 2.51 can hang on
exit while a client holds a gRPC stream (docs/serving.md, Shutdown, drain, grace period).

With an `admin_key`, the server loads its models in explicit mode behind a
repository API that needs that key, and `stop()` first unloads every model (new
requests are refused, running ones send their finals, finalize() runs), then ends
the server: tritonserver 2.51 otherwise spends its whole exit timeout waiting for
idle HTTP keep-alive connections and then exits without unloading anything.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from engine_lib.serving.processes import (DEFAULT_ADDRESS, REPO_ROOT, TritonServerError, connect_host, default_address,
                                          die_with_parent, env_int, hide_argument, proc_stat, release_reaper,
                                          signal_group, start_reaper, wait_group_gone)
from engine_lib.serving.wheel import find_pytriton_dist, prepare_backend_dir, server_env, system_tritonserver

DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
# Shared memory between tritonserver and each Python stub: one 1024x1024 RGB image
# is 3 MiB, a response of 4 is 12 MiB; start at 64 MiB and grow in 64 MiB steps.
DEFAULT_SHM_BYTES = 64 * 1024 * 1024
# With an admin key, the models are drained by unloading them before SIGTERM; what is left after it is only
# tritonserver's wait for idle HTTP keep-alive connections, cut this long after the SIGTERM (a SIGKILL: nothing
# of the models is left to lose). tritonserver's own exit timeout stays EXIT_TIMEOUT_SECS: a SIGTERM that
# reaches it from outside (an operator, systemd's control-group kill) must leave the gate's drain time to end
# the running requests, or it tears the stubs down under them and crashes.
DRAINED_EXIT_TIMEOUT_S = 3
LOADED_LINE = re.compile(rb"successfully loaded '([^']+)'")  # tritonserver's log line once a model is loaded
SIGNAL_LINE = re.compile(rb"^Signal \((\d+)\) received\.")  # ... once a signal starts its shutdown
SIGNAL_LINE_LAG_S = 3.0  # how long the log's signal line may trail the API going away (unload_all)
EXIT_TIMEOUT_LINE = b"Exit timeout expired"  # ... once it gives up waiting for running requests (it crashes next)
INSTANCE_LINE = re.compile(rb"TRITONBACKEND_ModelInstanceInitialize: (\S+) ")  # ... as a Python stub starts
ADMIN_HEADER = "admin-key"  # HTTP header; gRPC clients send it as "triton-grpc-protocol-admin-key"
# Triton's admin-like protocols, closed to clients without the admin key (HTTP and gRPC). shared-memory
# (system and CUDA) would let a client register any /dev/shm region, a Python stub's own included, as an
# output buffer and have inference overwrite it; the others load and unload models, read statistics, and
# change trace and log settings. health, metadata, inference and model-config stay open for clients.
RESTRICTED_PROTOCOLS = ("shared-memory", "model-repository", "statistics", "trace", "logging")


def default_http_address() -> str:
    """tritonserver's HTTP address: TRITON_HTTP_ADDRESS, else loopback whatever TRITON_ADDRESS says. One
    request can crash that port (a deeply nested JSON body: SIGSEGV, every model restarts) or have its
    integers wrapped; clients belong on the front door, and only an operator who puts a body-size-capping
    proxy in front of it opts in."""
    return os.environ.get("TRITON_HTTP_ADDRESS", "").strip() or DEFAULT_ADDRESS


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
        self.http_port = http_port or env_int("HTTP_PORT", 8000)
        self.grpc_port = grpc_port or env_int("GRPC_PORT", 8001)
        self.metrics_port = metrics_port or env_int("METRICS_PORT", 8002)
        self.address = address or default_address()  # metrics (and gRPC and HTTP unless given)
        self.http_address = http_address or default_http_address()
        self.grpc_address = grpc_address or self.address
        self.admin_key = admin_key
        self.load_models = list(load_models)  # with an admin key: the models loaded at start ("*": all)
        self.unloaded_cleanly: Optional[bool] = None  # set by stop(): every model unloaded before the exit
        self.shm_bytes = shm_bytes
        self.exit_timeout_s = exit_timeout_s if exit_timeout_s is not None else env_int("EXIT_TIMEOUT_SECS", 30)
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
            if not self._signal_logged_within(SIGNAL_LINE_LAG_S):
                return [f"(repository API unreachable: {exc})"]
            # A signal from outside stops the server meanwhile (it unloads the models itself): its exit says how.
            self.wait(max(0.0, deadline - time.monotonic()) + 5.0)
            return [] if self.exited_cleanly() else ["(tritonserver's own stop did not end cleanly)"]

    def _signal_logged_within(self, timeout_s: float) -> bool:
        """Whether the server's log says a signal started its shutdown, waiting up to timeout_s for the line: a
        whole process tree signalled at once (systemd, `docker stop`) may close the API before the log's thread
        has read the line that says why (seen under load: a broken pipe, then the line)."""
        deadline = time.monotonic() + timeout_s
        while self.signalled is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.signalled is not None

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
                signal_group(process.pid, signal.SIGTERM, only_leader=True)
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        if drain and self.was_ready and self.unloaded_cleanly is None:
            self.unloaded_cleanly = self.exited_cleanly()
        # Whatever is left in the group (the server after the grace period, orphaned stubs) is killed.
        signal_group(process.pid, signal.SIGKILL)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        wait_group_gone(process.pid, timeout_s=5.0)
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
