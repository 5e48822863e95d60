"""WorkerWatch: the engine thread's watch over its adapter's parallel worker group (parallel.py).

It notices a group that broke (a worker died, or a call timed out), starts a new one after a growing
wait, checks an idle group's liveness and reads what its ranks report for the metrics: the request states they
hold and their counters (the recompilations of the transformer each rank runs). What a broken
group means for the requests (each one it held ends with one final error) stays with the engine.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Optional

from engine_lib.parallel import WorkerError

logger = logging.getLogger(__name__)

RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)  # the waits before each next try to restart a broken worker group
WORKERS_CHECK_EVERY_S = 1.0  # an idle engine checks its parallel workers' liveness (parallel.py heartbeats) this often
RANK_STATES_EVERY_S = 1.0  # while the engine runs, the parallel workers' request states are counted this often


class WorkerWatch:
    """Why the adapter's worker group is down (`down`; None: up, or no group), when it tries a new one, the
    request states its ranks hold (`rank_states`) and the totals of their counters (`rank_counters`, summed over
    the ranks and every group so far, so that they only grow). Used by the engine thread only."""

    def __init__(self, adapter: Any):
        self.adapter = adapter
        self.down: Optional[str] = None
        self.restart_at = 0.0
        self.checked_at = 0.0
        self.failed_restarts = 0
        self.rank_states, self.rank_states_at = 0, 0.0
        self.rank_counters: dict[str, float] = {}
        self._earlier_groups: Counter = Counter()  # the counters of the groups that broke (a new one counts from 0)

    @property
    def workers(self) -> Any:
        return getattr(self.adapter, "workers", None)

    def broke(self) -> Optional[str]:
        """Why the group broke, the first time it is seen broken (None otherwise); the new group starts before the
        engine's next tick."""
        workers = self.workers
        self.checked_at = time.monotonic()
        if workers is None or self.down is not None or not workers.check():
            return None
        self.down, self.restart_at = workers.broken, time.monotonic()
        self.rank_states = 0  # (gone with the workers)
        self._earlier_groups = Counter(self.rank_counters)
        return workers.broken

    def count_rank_states(self, idle: bool) -> None:
        """What the parallel workers report (`report` of every rank: the request states they hold, their counters),
        for the metrics: whenever the engine goes idle (0 states unless one leaked) and every RANK_STATES_EVERY_S
        while it runs: one call to the ranks."""
        workers = self.workers
        now = time.monotonic()
        if workers is None or workers.broken or not (idle or now - self.rank_states_at >= RANK_STATES_EVERY_S):
            return
        self.rank_states_at = now
        try:
            reports = workers.call_all("report", [()] * workers.world_size)
        except WorkerError:  # (a dead worker: `broke` notices it)
            return
        totals = Counter(self._earlier_groups)
        for report in reports:
            totals.update(report)
        self.rank_states = int(totals.pop("held_states", 0))
        self.rank_counters = dict(totals)

    def with_rank_counters(self, counters: dict[str, float]) -> dict[str, float]:
        """The driver's `counters` with the ranks' totals added (the driver's own copy of a compiled transformer
        runs nothing under cfg_parallel: the ranks' recompilations are the ones that count)."""
        return {key: counters.get(key, 0.0) + self.rank_counters.get(key, 0.0)
                for key in {**counters, **self.rank_counters}}

    def check_due(self) -> bool:
        """Idle, a live worker group is still checked every WORKERS_CHECK_EVERY_S: a rank that died or went silent
        breaks it (and readiness says so) before a request finds out."""
        return (self.down is None and self.workers is not None
                and time.monotonic() - self.checked_at >= WORKERS_CHECK_EVERY_S)

    def idle_wait_s(self) -> Optional[float]:
        if self.down is not None:
            return self.restart_at - time.monotonic()
        return WORKERS_CHECK_EVERY_S if self.workers is not None else None

    def restart_due(self) -> bool:
        return self.down is not None and time.monotonic() >= self.restart_at

    def restart(self) -> bool:
        """A new worker group in place of the broken one (True once it runs); a start that fails is tried again after
        a growing wait (RESTART_BACKOFF_S), and meanwhile every request that would run ends UNAVAILABLE (the engine's
        tick)."""
        try:
            self.adapter.restart_workers()
        except Exception as exc:  # noqa: BLE001 - tried again later
            wait = RESTART_BACKOFF_S[min(self.failed_restarts, len(RESTART_BACKOFF_S) - 1)]
            self.failed_restarts += 1
            self.down, self.restart_at = f"restart failed: {exc}", time.monotonic() + wait
            logger.error("restarting %s's parallel workers failed (%s); next try in %g s", self.adapter.name, exc, wait)
            return False
        logger.info("%s's parallel workers restarted", self.adapter.name)
        self.down, self.failed_restarts = None, 0
        return True
