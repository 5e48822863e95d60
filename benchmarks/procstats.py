"""Resident memory of the tritonserver process tree, read from /proc.

The model lives in the Python backend stub processes (children of tritonserver),
so the server's own RSS says little: we sum VmRSS over the whole tree and keep
the peak of that sum, sampled on a background thread while a benchmark runs.
Shared pages (the Python backend's shm regions) are counted once per process
that maps them, so the sum is an upper bound.
"""

from __future__ import annotations

import os
import threading
from typing import Mapping, Optional

from engine_lib.serving.launcher import proc_stat


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            ppid = int(proc_stat(name)[1])
        except OSError:
            continue
        children.setdefault(ppid, []).append(int(name))
    return children


def process_tree(pid: int, children: Optional[dict[int, list[int]]] = None) -> list[int]:
    """pid and all its descendants that exist now (`children`: a ppid -> pids map, else read now)."""
    children = _children_map() if children is None else children
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def rss_bytes(pid: int) -> int:
    """VmRSS of one process in bytes (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss_bytes(pid: int, children: Optional[dict[int, list[int]]] = None) -> int:
    return sum(rss_bytes(p) for p in process_tree(pid, children))


class PeakRssSampler:
    """Context manager: samples each named tree's summed RSS every `interval_s`; `.peak_bytes[name]` after.

    One thread and one /proc scan per sample for all trees, so watching several
    idle servers costs next to nothing.
    """

    def __init__(self, pids: Mapping[str, int], interval_s: float = 1.0):
        self.pids = dict(pids)
        self.interval_s = interval_s
        self.peak_bytes: dict[str, int] = {name: 0 for name in self.pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)

    def sample_once(self) -> None:
        children = _children_map()
        for name, pid in self.pids.items():
            self.peak_bytes[name] = max(self.peak_bytes[name], tree_rss_bytes(pid, children))

    def _sample(self) -> None:
        while True:
            self.sample_once()
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> "PeakRssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds one process has used so far (0 when it is gone)."""
    try:
        fields = proc_stat(pid)
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_split(server_pid: Optional[int]) -> dict[str, float]:
    """CPU seconds so far of: this process (the load generator), tritonserver itself, and its children
    (the Python backend stubs that run the model). Differences of two calls give a run's split."""
    own = os.times()
    out = {"loadgen": own.user + own.system, "tritonserver": 0.0, "model": 0.0}
    if server_pid is not None:
        out["tritonserver"] = cpu_seconds(server_pid)
        out["model"] = sum(cpu_seconds(p) for p in process_tree(server_pid) if p != server_pid)
    return out
