"""Waiting on an engine from a test: until a condition holds, or tick by tick under a `TickBudget`."""

from __future__ import annotations

import time
from pathlib import Path


def wait_until(predicate, timeout: float) -> bool:
    """Whether `predicate()` holds within `timeout` seconds (polled every 10 ms)."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


class TickBudget:
    """An engine's tick budget (engine_lib/hooks.py's `FileTickBudget`), seen from a test.

    `hold()` stops the engine before its next tick; `allow(n)` lets exactly n more
    ticks (denoise steps of the running batch) run, then holds again; `release()`
    removes the limit. Works across processes (the file is the whole protocol), so
    server tests hold a tritonserver's engine the same way.
    """

    def __init__(self, path: Path):
        self.path = Path(path)

    def hold(self) -> "TickBudget":
        return self.allow(0)

    def allow(self, ticks: int) -> "TickBudget":
        from engine_lib.hooks import write_atomically

        write_atomically(str(self.path), str(ticks))
        return self

    def release(self) -> None:
        """Remove the file, and again if the engine wrote it back: a tick that read the budget just before
        the unlink writes the decremented value after it (a held engine only reads)."""
        for _ in range(200):
            self.path.unlink(missing_ok=True)
            time.sleep(0.05)
            if not self.path.exists():
                time.sleep(0.05)
                if not self.path.exists():
                    return

    def left(self):
        """Ticks still allowed (None: no limit)."""
        try:
            return int(self.path.read_text() or 0)
        except FileNotFoundError:
            return None

    def hooks(self):
        """EngineHooks for an in-process engine held by this budget."""
        from engine_lib.hooks import EngineHooks, FileTickBudget

        return EngineHooks(tick_gate=FileTickBudget(str(self.path)))
