"""Where a thread's time goes, per named phase: monotone totals that metrics and benchmarks read.

The engine thread splits each tick into admission (`schedule`), `prepare` (prompt
encode, noise, schedule), `gather`, `forward`, `scheduler` (each request's step),
`previews`, `decode`, `convert` (outputs to the declared dtypes and to the host)
and `emit` (handing outputs to the streams); the sender adds `encode` (output
tensors, PNG, mp4: on its encoding pool) and `send`. Totals only grow, so a
scrape before and after a run gives the run's split
(`diffusion_engine_phase_seconds_total{phase}`).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

ENGINE_PHASES = ("schedule", "prepare", "gather", "forward", "scheduler", "previews", "decode", "convert", "emit")
SENDER_PHASES = ("encode", "send")
PHASES = ENGINE_PHASES + SENDER_PHASES


class PhaseClock:
    """Seconds spent per phase. Written by one thread; read (copied) by any."""

    def __init__(self) -> None:
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._lock = threading.Lock()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self._totals[name] += seconds

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._totals)
