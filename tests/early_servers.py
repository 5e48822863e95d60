"""Servers started early: right after collection, in the background, at a low CPU priority.

A server's start is mostly its stub importing torch and diffusers and loading a pipeline on one core while
pytest waits, and most tests before the served ones run in-process on one core (OMP_NUM_THREADS=1). A fixture
marked with `starts_early(start)` has its server started after collection (tests/conftest.py:
pytest_collection_finish) by `start(tmp_path_factory)`, which returns without waiting for readiness, so that
the start overlaps those tests on the other core; the low priority keeps it from slowing them. The fixture
takes it with `take_early` (its priority back to normal) and waits until it is ready. Servers nobody took are
stopped with the session.

One module, imported as tests.early_servers everywhere: pytest imports tests/conftest.py a second time under
another name, and both must see one registry.
"""

from __future__ import annotations

import os
from pathlib import Path

EARLY_NICENESS = 10
_starters: dict = {}  # a marked fixture function -> its start
_early: dict = {}  # a start -> its server, started after collection and not yet taken


def starts_early(start):
    """Mark a fixture function (under @pytest.fixture) whose server `start(tmp_path_factory)` starts early."""
    def mark(fixture_function):
        _starters[fixture_function] = start
        return fixture_function
    return mark


def renice_tree(pid: int, niceness: int) -> None:
    """Set the CPU priority of process `pid` and of its descendants (where allowed: raising one back may not be)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    tree = {pid}
    while children := {child for child, parent in parents.items() if parent in tree} - tree:
        tree |= children
    for member in tree:
        try:
            os.setpriority(os.PRIO_PROCESS, member, niceness)
        except OSError:
            pass


def start_marked(session) -> None:
    """Start the server of every marked fixture that a selected test uses, in the order the tests need them."""
    if session.config.option.collectonly:
        return
    for item in session.items:
        info = getattr(item, "_fixtureinfo", None)
        for definitions in (info.name2fixturedefs.values() if info else ()):
            start = _starters.get(definitions[-1].func)
            if start is not None and start not in _early:
                _early[start] = started = start(session.config._tmp_path_factory)
                renice_tree(started.process.pid, EARLY_NICENESS)


def take_early(start, tmp_path_factory):
    """The server of `start`, the one a marked fixture gave starts_early: the one started early (its priority
    back to normal), else one started now. The caller waits until it is ready."""
    started = _early.pop(start, None)
    if started is None:
        return start(tmp_path_factory)
    renice_tree(started.process.pid, 0)
    return started


def stop_untaken() -> None:
    while _early:
        started = _early.popitem()[1]
        (getattr(started, "stop", None) or started.kill)()  # a TritonServer, or a tests/serving/launched.py Launcher
