"""Servers started early: right after collection, in the background, at a low CPU priority.

A server's start is mostly its stub importing torch and diffusers and loading a pipeline on one core while
pytest waits, and most tests run on one core (OMP_NUM_THREADS=1; a served test mostly waits for its server's
single-threaded engine). A fixture marked with `starts_early(start)` has its server (or any object with a
subprocess `process` and a `stop()`) started after collection
(tests/conftest.py: pytest_collection_finish) by `start(tmp_path_factory)`, which returns without waiting for
readiness, so that the start overlaps the tests before it on the other core; the low priority keeps it from
slowing them. With `ahead=True` (a module's own server) it starts only once it is among the next AHEAD such
servers the tests will need, so that few idle servers hold memory at once. The fixture takes it with
`take_early` (its priority back to normal) and waits until it is ready. Servers nobody took are stopped with
the session.
"""

from __future__ import annotations

import os
from pathlib import Path

EARLY_NICENESS = 19  # the lowest: an early start takes only what the tests leave idle
AHEAD = 2  # servers marked `ahead` that are started and not yet taken, at most
_starters: dict = {}  # a marked fixture function -> its start
_early: dict = {}  # a start -> its server, started early and not yet taken
_pending: list = []  # the starts marked `ahead` not started yet, in the order the tests need them
_ahead: set = set()  # every start marked `ahead`
_factory = None  # the session's tmp_path_factory


def starts_early(start, ahead: bool = False):
    """Mark a fixture function (under @pytest.fixture) whose server `start(tmp_path_factory)` starts early."""
    def mark(fixture_function):
        _starters[fixture_function] = start
        if ahead:
            _ahead.add(start)
        return fixture_function
    return mark


def process_tree(pid: int) -> set[int]:
    """Process `pid` and its descendants, whatever their process groups and sessions."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    tree = {pid}
    while children := {child for child, parent in parents.items() if parent in tree} - tree:
        tree |= children
    return tree


def renice_tree(pid: int, niceness: int) -> None:
    """Set the CPU priority of process `pid` and of its descendants (where allowed: raising one back may not be)."""
    for member in process_tree(pid):
        try:
            os.setpriority(os.PRIO_PROCESS, member, niceness)
        except OSError:
            pass


def start_marked(session) -> None:
    """Start the server of every marked fixture that a selected test uses, in the order the tests need them."""
    global _factory
    if session.config.option.collectonly:
        return
    _factory = session.config._tmp_path_factory
    for item in session.items:
        info = getattr(item, "_fixtureinfo", None)
        for definitions in (info.name2fixturedefs.values() if info else ()):
            start = _starters.get(definitions[-1].func)
            if start is None or start in _early or start in _pending:
                continue
            if start in _ahead:
                _pending.append(start)
            else:
                _start(start)
    _start_ahead()


def _start(start) -> None:
    _early[start] = started = start(_factory)
    if may_restore_priority():
        renice_tree(started.process.pid, EARLY_NICENESS)


def may_restore_priority() -> bool:
    """Whether this process may give a process its normal priority back (RLIMIT_NICE, or CAP_SYS_NICE): if not,
    servers start early at the normal priority, lest their tests run at the lowest."""
    import resource  # noqa: PLC0415

    if resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20:
        return True
    status = Path("/proc/self/status").read_text()
    effective = next((line.split()[1] for line in status.splitlines() if line.startswith("CapEff:")), "0")
    return bool(int(effective, 16) >> 23 & 1)  # bit 23: CAP_SYS_NICE


def _start_ahead() -> None:
    while _pending and len(_ahead & set(_early)) < AHEAD:
        _start(_pending.pop(0))


def take_early(start, tmp_path_factory):
    """The server of `start`, the one a marked fixture gave starts_early: the one started early (its priority
    back to normal), else one started now. The caller waits until it is ready."""
    started = _early.pop(start, None)
    if start in _pending:
        _pending.remove(start)
    _start_ahead()
    if started is None:
        return start(tmp_path_factory)
    renice_tree(started.process.pid, 0)
    return started


def serve_early(start, tmp_path_factory):
    """A fixture's body for the server of `start`: taken (take_early), ready, yielded, cleaned up after."""
    srv = take_early(start, tmp_path_factory)
    try:
        srv.wait_ready(600)
        yield srv
    finally:
        srv.cleanup()


def stop_untaken() -> None:
    while _early:
        started = _early.popitem()[1]
        (getattr(started, "stop", None) or started.kill)()  # a TritonServer, or a tests/helpers/launched.py Launcher
