"""Keep one tritonserver serving: restart it when it, or one of its Python stubs, dies.

Why a restart for a dead stub: tritonserver 2.51 keeps the requests a killed stub held
open forever (no response, no error), keeps reporting the model ready, and a repository
reload starts a new stub but leaves those requests, and the old stub's shared memory,
behind (measured, and re-checked: docs/serving.md, Supervision). Ending the server is the one thing that ends them: gRPC clients get
UNAVAILABLE ("Socket closed") at once, HTTP clients a closed connection.

The stubs are watched from the server's start, not from its readiness: tritonserver opens its
ports only once every model has loaded, and a stub killed before then (its model loaded, another
still loading) leaves a model that says ready and never answers. A stub that goes (a zombie or
reaped: tritonserver reaps some killed stubs itself) is dead once its model has loaded, as the
server's log says (tritonserver.TritonServer._copy_log; its instance start lines also name the stubs
a look may have missed); a stub of a model still loading that goes is a failed load, which tritonserver
turns into a failed start (exit 1), as is any stub that goes once a load has failed.

On a death the supervisor logs one line, SIGTERMs what is left of the server (its HTTP
port stops answering at once, so readiness is never reported while requests fail),
gives the other models' running requests up to `stub_drain_s` (the drain ends as soon as
their gauges show none: `in_flight`), kills the rest, removes the server's /dev/shm
regions, and starts a new server at once (while servers keep dying within a minute of their
readiness, after a backoff of 0, 1, 2, 4, ... 30 s). Each start gets the number of restarts so far in
DIFFUSION_SERVER_RESTARTS, which the models export as the gauge diffusion_server_restarts.

A signal from outside the launcher that reaches tritonserver alone (an operator's SIGTERM) starts its own
shutdown: it refuses new requests and waits for the running ones up to its exit timeout. The supervisor
then has the gate end them (`on_stopping`: each gets its final, or UNAVAILABLE "server shutting down"
after the gate's drain), waits for the server's exit, and starts a new one. A server that is alive but
does not answer its health endpoint for HEALTH_TIMEOUT_S (stopped, deadlocked) is killed and restarted.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from typing import Callable, Optional

from engine_lib.serving.tritonserver import TritonServer

BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
HEALTHY_AFTER_S = 60.0  # a server up this long resets the backoff
HEALTH_EVERY_S = 1.0  # how often a ready server's /v2/health/live is asked
HEALTH_TIMEOUT_S = 30.0  # unanswered this long: the server is stuck (a busy server answers within 2 s; a host so
# loaded that tritonserver's HTTP threads starve must not cost a restart)
RESTARTS_ENV = "DIFFUSION_SERVER_RESTARTS"
# The gauges of requests a model still holds: Triton's queue, and the engine's own (engine_lib/serving/metrics.py).
IN_FLIGHT_GAUGES = ("nv_inference_pending_request_count", "diffusion_requests_waiting", "diffusion_requests_running",
                    "diffusion_open_streams")
DRAINED_FOR_S = 0.6  # in_flight must read 0 this long: the engine's gauges are sampled twice a second
SAMPLE = re.compile(r'^(\w+)\{([^}]*)\} (\S+)$', re.M)
LABEL = re.compile(r'(\w+)="([^"]*)"')
INSTANCE = re.compile(r"^(.+)_\d+_\d+$")  # a model instance's name: <model>_<group>_<index>


def model_of(instance: str) -> Optional[str]:
    """The model of an instance name (qwen_image_0_0 -> qwen_image); None for a stub that serves no instance."""
    found = INSTANCE.match(instance)
    return found.group(1) if found else None


def in_flight(metrics: str, dead_instance: str) -> int:
    """Requests the models hold according to a /metrics scrape, leaving out the dead instance's (its stub's
    gauges stay as they were when it died) and its model's Triton queue (that queue waits for the dead stub)."""
    total = 0.0
    for name, labels, value in SAMPLE.findall(metrics):
        if name in IN_FLIGHT_GAUGES:
            labels = dict(LABEL.findall(labels))
            if "instance" in labels:
                total += float(value) if labels["instance"] != dead_instance else 0.0
            else:
                total += float(value) if labels.get("model") != model_of(dead_instance) else 0.0
    return int(total)


class Backoff:
    """The pause before a restart: none after a run of HEALTHY_AFTER_S or more (or the first time), else 1, 2,
    4, ... 30 s as quick failures repeat. `up()` when the restarted thing serves, `failed()` when it dies or
    does not start: the pause to take. Owned by one thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.failures = 0  # quick failures in a row
        self.up_at: Optional[float] = None  # when it last began to serve (None: not since its last failure)

    def up(self) -> None:
        self.up_at = self.clock()

    def failed(self) -> float:
        healthy = self.up_at is not None and self.clock() - self.up_at >= HEALTHY_AFTER_S
        self.failures = 0 if healthy else self.failures + 1
        self.up_at = None
        return BACKOFF_S[min(max(self.failures - 1, 0), len(BACKOFF_S) - 1)]


class Supervisor:
    """Runs servers made by `make_server(restarts)` until `stop` is set.

    `on_ready(server)` runs once each server is ready (the launcher prints its
    addresses); `on_stopping(server)` once a signal from outside starts a server's shutdown
    (the launcher has the gate end its requests). `run()` returns the exit code: 0 when
    stopped on request and every model unloaded cleanly, 1 otherwise (including a first
    start that fails, which is a configuration error, not a crash, and is not retried).
    """

    def __init__(self, make_server: Callable[[int], TritonServer], stop: threading.Event,
                 on_ready: Callable[[TritonServer], None] = lambda server: None,
                 log: Callable[[str], None] = lambda line: print(line, flush=True),
                 start_timeout_s: float = 600.0, stub_drain_s: float = 10.0, poll_s: float = 0.2,
                 on_stopping: Callable[[TritonServer], None] = lambda server: None, clock: Callable[[], float] = time.monotonic):
        self.make_server = make_server
        self.stop = stop
        self.on_ready = on_ready
        self.on_stopping = on_stopping
        self.clock = clock
        self.log = log
        self.start_timeout_s = start_timeout_s
        self.stub_drain_s = stub_drain_s
        self.poll_s = poll_s
        self.restarts = 0
        self.server: Optional[TritonServer] = None
        self.ready_at: Optional[float] = None  # when the current server became ready (None: not yet)
        self.backoff = Backoff(clock)

    def run(self) -> int:
        while not self.stop.is_set():
            server = self.server = self.make_server(self.restarts)
            try:
                server.start(timeout_s=self.start_timeout_s, wait=False)
                death = self._watch(server)
            except Exception as exc:  # noqa: BLE001 - TritonServerError, or the server could not be made
                server.cleanup()
                if self.restarts == 0:
                    self.log(f"launcher: {exc}")
                    return 1
                self.log(f"launcher: restart {self.restarts} failed to start: {str(exc).splitlines()[0]}")
                self.stop.wait(self.backoff.failed())
                continue
            if death is None:  # stop requested: drain the models if they serve
                server.stop()
                server.cleanup()
                return 0 if server.unloaded_cleanly in (True, None) else 1
            what, dead_instance = death
            self.restarts += 1
            pause = self.backoff.failed()
            self.log(f"launcher: {what}; restarting tritonserver (restart {self.restarts})")
            noticed = time.monotonic()
            drained = self._drain(server, dead_instance) if dead_instance and self.ready_at is not None else 0.0
            if server.stopping_on_its_own:  # its own shutdown: the gate ends its requests, then it exits by itself
                self.on_stopping(server)
                server.stop(drain=False)
                self.log(f"launcher: tritonserver exited with code {server.process.returncode} after its drain")
            else:
                server.stop(grace_s=0, drain=False)
            server.cleanup()
            self.log(f"launcher: the server of restart {self.restarts} stopped {time.monotonic() - noticed:.1f} s "
                     f"after the death was noticed (drain {drained:.1f} s)")
            if server.leaked_shm:
                self.log(f"launcher: removed the dead server's shared memory: {', '.join(server.leaked_shm)}")
            self.stop.wait(pause)
        return 0

    def _watch(self, server: TritonServer) -> Optional[tuple[str, str]]:
        """Watch a server from its start until a stop is requested (None) or something dies: (what died, as a log
        phrase; the dead stub's instance, "" when the server died). Runs `on_ready` once the server is ready; a
        start that fails raises (server.check_ready)."""
        known: dict[int, str] = {}  # the stubs of the last look, pid -> instance
        ready = False
        self.ready_at = None
        answered = asked = self.clock()  # the last /v2/health/live answer, and the last question
        while not self.stop.wait(self.poll_s):
            if server.stopping_on_its_own:
                return f"tritonserver received signal {server.signalled} from outside the launcher", ""
            if not ready:
                ready = server.check_ready(self.start_timeout_s)  # raises if it exited or timed out
                if ready:
                    self.ready_at = answered = self.clock()
                    self.backoff.up()
                    self.on_ready(server)
            elif server.process.poll() is not None:
                return f"tritonserver exited unexpectedly (exit code {server.process.returncode})", ""
            elif self.clock() - asked >= HEALTH_EVERY_S:
                asked = self.clock()
                if server.is_live():
                    answered = asked
                elif asked - answered >= HEALTH_TIMEOUT_S:
                    return (f"tritonserver (pid {server.process.pid}) did not answer its health endpoint for "
                            f"{asked - answered:.0f} s"), ""
            stubs = server.stub_pids()
            loaded = server.loaded_models  # read after the stubs: a model loads before its stub can go
            gone = [(f"{instance} (pid {pid})", instance) for pid, instance in known.items() if pid not in stubs]
            # A stub that came and went between two looks is known by its instance's log line.
            gone += [(instance, instance) for instance in server.instances - {*stubs.values(), *known.values()}]
            for name, instance in gone:
                if model_of(instance) not in loaded or not server.is_running():
                    continue  # a load that failed (tritonserver fails the start), or the server's own death
                if ready or not self._load_failed(server):
                    return f"the Python stub of {name} died", instance
            known = stubs
        return None

    def _load_failed(self, server: TritonServer) -> bool:
        """Whether a start is failing: a load failed, so tritonserver unloads the loaded models and exits. The log
        says so before the unload begins; one more poll gives its copy (TritonServer._copy_log) time to read it."""
        self.stop.wait(self.poll_s)
        return server.load_failed or not server.is_running()

    def _drain(self, server: TritonServer, dead_instance: str) -> float:
        """SIGTERM the server and wait, up to `stub_drain_s`, until no model but the dead one holds a request
        (in_flight reads 0 for DRAINED_FOR_S) or the server exits; the seconds it took. Unreadable metrics: the
        full wait."""
        began = time.monotonic()
        server.send_signal()
        drained_since = None
        while time.monotonic() - began < self.stub_drain_s and server.is_running():
            try:
                with urllib.request.urlopen(server.metrics_url, timeout=2) as reply:
                    busy = in_flight(reply.read().decode(errors="replace"), dead_instance)
            except OSError:
                busy = None
            if busy == 0:
                drained_since = drained_since or time.monotonic()
                if time.monotonic() - drained_since >= DRAINED_FOR_S:
                    break
            else:
                drained_since = None
            time.sleep(0.2)
        return time.monotonic() - began
