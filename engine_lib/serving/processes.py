"""The launcher's child processes: how each is started, watched and ended.

`ChildProcess` is the one base of the two long-lived children next to tritonserver: `GrpcGate` (grpc_gate.py,
the public gRPC port, which refuses oversized messages before tritonserver reads them) and `OpenAIFrontDoor`
(engine_lib/serving/openai_api: the OpenAI Images API and strict generate endpoints). Both are started with
`spawn` (they die with the launcher), answer once they serve, and stop within a bounded time.

tritonserver itself (tritonserver.py) runs in its own process group with its stubs; `start_reaper` ends that
group and its shared memory if the launcher dies without stopping it, and `signal_group` / `wait_group_gone`
end it on a stop. `hide_argument` takes a secret out of a child's command line.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ADDRESS = "127.0.0.1"  # loopback unless told otherwise: nothing is exposed by default


class TritonServerError(RuntimeError):
    """tritonserver, the gate or the front door could not be found, did not start, or exited early (message has
    the log tail)."""


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def default_address() -> str:
    return os.environ.get("TRITON_ADDRESS", "").strip() or DEFAULT_ADDRESS


_handed_out: set[int] = set()  # every port free_port gave this process
_handed_out_lock = threading.Lock()


def free_port() -> int:
    """A TCP port free on loopback now, and never one this process was given before: nothing listens on a port
    between two calls, so the kernel may hand out the same one twice, and a server given it for two of its
    listeners (gRPC and metrics) would fail to start."""
    while True:
        with socket.socket() as sock:
            sock.bind((DEFAULT_ADDRESS, 0))
            port = sock.getsockname()[1]
        with _handed_out_lock:
            if port not in _handed_out:
                _handed_out.add(port)
                return port


def connect_host(address: str) -> str:
    """Where to connect to a port that listens on `address` (every interface: loopback)."""
    return "127.0.0.1" if address in ("0.0.0.0", "") else address


def python_path(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with this repository first on PYTHONPATH: a child runs engine_lib from here."""
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)}


class ChildProcess:
    """A child of the launcher that lives as long as it does (it reconnects to a restarted server by itself):
    its process, its console or log, and the bounded stop and log tail both children share."""

    def __init__(self, host: str, port: int, log_path: Optional[os.PathLike | str] = None,
                 env: Optional[Mapping[str, str]] = None, drain_s: float = 5.0):
        self.host = host
        self.port = port
        self.drain_s = drain_s  # at SIGTERM, how long its running requests may still take
        self.log_path = Path(log_path) if log_path else None  # None: the launcher's console
        self.env = dict(os.environ if env is None else env)
        self.process: Optional[subprocess.Popen] = None

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


class OpenAIFrontDoor(ChildProcess):
    """The OpenAI front door (`python -m engine_lib.serving.openai_api`) as a child process.

    `start()` waits until its /health answers; a process that exits first, or a timeout,
    raises TritonServerError with its output's tail. `stop()` is bounded (SIGTERM, then SIGKILL).
    """

    def __init__(self, triton_grpc_url: str, host: str = "127.0.0.1", port: Optional[int] = None,
                 log_path: Optional[os.PathLike | str] = None, env: Optional[Mapping[str, str]] = None,
                 drain_s: float = 5.0):
        super().__init__(host, port if port is not None else env_int("OPENAI_PORT", 9000), log_path, env, drain_s)
        self.triton_grpc_url = triton_grpc_url

    @property
    def url(self) -> str:
        return f"http://{connect_host(self.host)}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "OpenAIFrontDoor":
        command = [sys.executable, "-m", "engine_lib.serving.openai_api", "--triton", self.triton_grpc_url,
                   "--host", self.host, "--port", str(self.port), f"--drain-s={self.drain_s:g}"]
        self.process = spawn(command, python_path(self.env), self.log_path)
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


class GrpcGate(ChildProcess):
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
        super().__init__(host, port, log_path, env, drain_s)
        self.upstream = upstream
        self.max_message_bytes = max_message_bytes

    @property
    def url(self) -> str:
        return f"{connect_host(self.host)}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "GrpcGate":
        from engine_lib.serving.grpc_gate import MAX_MESSAGE_ENV, READY_FD_ENV  # noqa: PLC0415 (imports grpc)

        # The gate says it listens on a pipe: a connection to the port could reach whoever else holds it.
        ready_read, ready_write = os.pipe()
        env = python_path({**self.env, MAX_MESSAGE_ENV: str(self.max_message_bytes), READY_FD_ENV: str(ready_write)})
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


def signal_group(pid: int, sig: int, only_leader: bool = False) -> None:
    try:
        if only_leader:
            os.kill(pid, sig)
        else:
            os.killpg(pid, sig)  # start_new_session made the server its group's leader
    except (ProcessLookupError, PermissionError):
        pass


def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """Wait (bounded) until no process of the group is left, so callers can reuse its ports and shm."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return True
        time.sleep(0.05)
    return False
