"""The supervisor's watch with fake servers (no tritonserver): what it takes for a stub's death, from when.

Each fake server follows a script, one step per poll: whether it is ready, its live stubs, its zombies,
and whether it has exited. tests/serving/test_supervision.py kills real stubs.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from engine_lib.serving import supervisor
from engine_lib.serving.supervisor import Supervisor


class FakeServer:
    def __init__(self, steps: list[dict], stop: threading.Event):
        self.steps, self.stop_event, self.polls = steps, stop, 0
        self.process = SimpleNamespace(poll=lambda: self.step.get("exited"), returncode=None)
        self.unloaded_cleanly, self.leaked_shm, self.stops = None, [], []

    @property
    def step(self) -> dict:
        return self.steps[min(self.polls, len(self.steps) - 1)]

    def start(self, timeout_s: float, wait: bool) -> "FakeServer":
        assert not wait, "the supervisor waits for readiness itself, while it watches"
        return self

    def check_ready(self, timeout_s: float) -> bool:
        if self.step.get("exited") is not None:
            raise RuntimeError(f"tritonserver exited with code {self.step['exited']} before it was ready")
        return self.step.get("ready", False)

    def is_ready(self) -> bool:
        return self.step.get("ready", False)

    def stub_pids(self) -> dict[int, str]:
        live = dict(self.step.get("stubs", {}))
        self.polls += 1
        if self.polls > len(self.steps):
            self.stop_event.set()  # the script played, its last step twice: stop the supervisor
        return live

    def is_running(self) -> bool:
        return self.step.get("exited") is None

    def is_zombie(self, pid: int) -> bool:
        return pid in self.steps[self.polls - 1].get("zombies", ())

    def stop(self, grace_s=None, drain=True):
        self.stops.append({"grace_s": grace_s, "drain": drain})

    def cleanup(self):
        pass


def supervise(*scripts: list[dict]) -> tuple[int, list[str], list[FakeServer], list[FakeServer]]:
    """Run a supervisor over servers following `scripts` (one per start); returns its exit code, its log,
    the servers made and those it reported ready."""
    stop = threading.Event()
    made: list[FakeServer] = []
    ready: list[FakeServer] = []
    log: list[str] = []

    def make_server(restarts: int) -> FakeServer:
        made.append(FakeServer(scripts[restarts], stop))
        return made[-1]

    code = Supervisor(make_server, stop, on_ready=ready.append, log=log.append, poll_s=0, stub_drain_s=3).run()
    return code, log, made, ready


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    monkeypatch.setattr(supervisor, "BACKOFF_S", (0.0,))


LOADING = {"stubs": {10: "echo_0_0", 11: "slow_0_0"}}  # echo loaded, slow still loading: not ready


def test_a_stub_killed_while_other_models_load_restarts_the_server():
    code, log, made, ready = supervise(
        [LOADING, {"stubs": {11: "slow_0_0"}, "zombies": {10}}],
        [{"ready": True, "stubs": {20: "echo_0_0", 21: "slow_0_0"}}])
    assert log == ["launcher: the Python stub of echo_0_0 (pid 10) died; restarting tritonserver (restart 1)"]
    assert made[0].stops[0] == {"grace_s": 3, "drain": False}  # the drain as for any death
    assert ready == [made[1]] and code == 0


def test_a_stub_tritonserver_ended_itself_before_readiness_is_not_a_death():
    """The stub that completes a model's configuration ends before the model loads, and tritonserver reaps it."""
    code, log, made, ready = supervise(
        [{"stubs": {5: "echo"}}, {"stubs": {}}, LOADING, {"ready": True, **LOADING}])
    assert log == [] and ready == made and code == 0


def test_a_first_start_whose_load_fails_exits_1_without_a_restart():
    code, log, made, ready = supervise([LOADING, {"stubs": {11: "slow_0_0"}}, {"exited": 1}])
    assert code == 1 and len(made) == 1 and not ready
    assert log == ["launcher: tritonserver exited with code 1 before it was ready"]


def test_once_ready_a_stub_that_goes_is_dead_zombie_or_not():
    code, log, made, ready = supervise(
        [{"ready": True, **LOADING}, {"ready": True, "stubs": {10: "echo_0_0"}}],
        [{"ready": True, **LOADING}])
    assert log == ["launcher: the Python stub of slow_0_0 (pid 11) died; restarting tritonserver (restart 1)"]
    assert ready == made and code == 0
