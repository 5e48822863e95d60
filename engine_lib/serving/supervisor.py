"""Keep one tritonserver serving: restart it when it, or one of its Python stubs, dies.

Why a restart for a dead stub: tritonserver 2.51 keeps the requests a killed stub held
open forever (no response, no error), keeps reporting the model ready, and a repository
reload starts a new stub but leaves those requests, and the old stub's shared memory,
behind (measured). Ending the server is the one thing that ends them: gRPC clients get
UNAVAILABLE ("Socket closed") at once, HTTP clients a closed connection.

On a death the supervisor logs one line, SIGTERMs what is left of the server (its HTTP
port stops answering at once, so readiness is never reported while requests fail),
gives the other models' running requests `stub_drain_s`, kills the rest, removes the
server's /dev/shm regions, and starts a new server after a backoff (1, 2, 4, ... 30 s;
back to 1 s after a minute of health). Each start gets the number of restarts so far in
DIFFUSION_SERVER_RESTARTS, which the models export as the gauge diffusion_server_restarts.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
HEALTHY_AFTER_S = 60.0  # a server up this long resets the backoff
RESTARTS_ENV = "DIFFUSION_SERVER_RESTARTS"


class Supervisor:
    """Runs servers made by `make_server(restarts)` (launcher.TritonServer objects; not imported:
    the launcher imports this module) until `stop` is set.

    `on_ready(server)` runs after each successful start (the launcher prints its
    addresses). `run()` returns the exit code: 0 when stopped on request and every
    model unloaded cleanly, 1 otherwise (including a first start that fails, which is
    a configuration error, not a crash, and is not retried).
    """

    def __init__(self, make_server: Callable[[int], Any], stop: threading.Event,
                 on_ready: Callable[[Any], None] = lambda server: None,
                 log: Callable[[str], None] = lambda line: print(line, flush=True),
                 start_timeout_s: float = 600.0, stub_drain_s: float = 10.0, poll_s: float = 0.2):
        self.make_server = make_server
        self.stop = stop
        self.on_ready = on_ready
        self.log = log
        self.start_timeout_s = start_timeout_s
        self.stub_drain_s = stub_drain_s
        self.poll_s = poll_s
        self.restarts = 0
        self.server: Any = None

    def run(self) -> int:
        failures = 0
        while not self.stop.is_set():
            server = self.server = self.make_server(self.restarts)
            try:
                server.start(timeout_s=self.start_timeout_s)
            except Exception as exc:  # noqa: BLE001 - launcher.TritonServerError, or the server could not be made
                server.cleanup()
                if self.restarts == 0:
                    self.log(f"launcher: {exc}")
                    return 1
                self.log(f"launcher: restart {self.restarts} failed to start: {str(exc).splitlines()[0]}")
                failures += 1
                self._pause(failures)
                continue
            started = time.monotonic()
            self.on_ready(server)
            death = self._watch(server)
            if death is None:  # stop requested
                server.stop()
                server.cleanup()
                return 0 if server.unloaded_cleanly in (True, None) else 1
            self.restarts += 1
            failures = 0 if time.monotonic() - started >= HEALTHY_AFTER_S else failures + 1
            self.log(f"launcher: {death}; restarting tritonserver (restart {self.restarts})")
            server.stop(grace_s=self.stub_drain_s, drain=False)
            server.cleanup()
            if server.leaked_shm:
                self.log(f"launcher: removed the dead server's shared memory: {', '.join(server.leaked_shm)}")
            self._pause(failures)
        return 0

    def _watch(self, server: Any) -> Optional[str]:
        """Wait until a stop is requested (None) or something dies (what died, as a log phrase)."""
        known: dict[int, str] = {}
        while not self.stop.wait(self.poll_s):
            code = server.process.poll()
            if code is not None:
                return f"tritonserver exited unexpectedly (exit code {code})"
            stubs = server.stub_pids()
            for pid, instance in known.items():
                if pid not in stubs and server.is_running():
                    return f"the Python stub of {instance} (pid {pid}) died"
            known.update(stubs)
        return None

    def _pause(self, failures: int) -> None:
        self.stop.wait(BACKOFF_S[min(max(failures - 1, 0), len(BACKOFF_S) - 1)])
