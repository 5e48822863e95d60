"""engine_lib/parallel.py with a light handler (no pipeline): two CPU ranks over gloo, one group for the module.

What a worker group promises the engine: rank 0's answer, the ranks' own collectives, a handler error that fails
one call only, and a silent worker that fails the call at the timeout instead of hanging it (the last test, as
it breaks the group).
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist

from engine_lib.parallel import DEFAULT_TIMEOUT_S, HEARTBEAT_TIMEOUT_S, WorkerError, WorkerGroup


class Probe:
    """One rank's handler."""

    def __init__(self, rank: int, world_size: int, device: torch.device):
        self.rank = rank

    def ranks(self, value: torch.Tensor) -> torch.Tensor:
        """Every rank's value gathered over the group (rank 0's answer is the call's)."""
        values = [torch.empty_like(value) for _ in range(dist.get_world_size())]
        dist.all_gather(values, value + self.rank)
        return torch.stack(values)

    def fail_on(self, rank: int) -> None:
        if rank == self.rank:
            raise ValueError(f"planted failure on rank {rank}")


@pytest.fixture(scope="module")
def group():
    group = WorkerGroup(Probe, [torch.device("cpu")] * 2, timeout_s=2)
    yield group
    group.close()


def test_rank_0_answers_what_the_ranks_computed_together(group):
    assert group.call("ranks", [(torch.tensor([10.0]),), (torch.tensor([20.0]),)]).tolist() == [[10.0], [21.0]]


def test_call_all_answers_every_rank_s_result(group):
    assert [t.tolist() for t in group.call_all("ranks", [(torch.tensor([1.0]),)] * 2)] == [[[1.0], [2.0]]] * 2


def test_a_handler_error_fails_its_call_only(group):
    with pytest.raises(WorkerError, match="(?s)rank 1: .*planted failure on rank 1"):
        group.call("fail_on", [(1,), (1,)])
    assert not group.broken
    assert group.call("ranks", [(torch.tensor([1.0]),)] * 2).tolist() == [[1.0], [2.0]]


def test_a_silent_worker_fails_the_call_at_the_timeout_and_breaks_the_group(group):
    os.kill(group.processes[1].pid, signal.SIGSTOP)
    try:
        with pytest.raises(WorkerError, match=r"did not answer within 2 s"):
            group.call("ranks", [(torch.tensor([1.0]),)] * 2)
        with pytest.raises(WorkerError, match="broken"):
            group.call("ranks", [(torch.tensor([1.0]),)] * 2)
    finally:
        os.kill(group.processes[1].pid, signal.SIGCONT)
    group.close()
    assert not any(process.is_alive() for process in group.processes)


def test_a_stopped_rank_fails_the_call_at_its_heartbeat_not_at_the_timeout():
    """SIGSTOP of rank 1 while rank 0 waits for it in a collective: its heartbeat thread stops with it, so the call
    fails after HEARTBEAT_TIMEOUT_S with the group broken, not after the call's own timeout (the shipped 300 s)
    or the collectives'. An idle engine asks `check()` each second, which reads the same heartbeats."""
    group = WorkerGroup(Probe, [torch.device("cpu")] * 2, timeout_s=DEFAULT_TIMEOUT_S)
    try:
        assert group.call("ranks", [(torch.tensor([1.0]),)] * 2).tolist() == [[1.0], [2.0]]
        os.kill(group.processes[1].pid, signal.SIGSTOP)
        with pytest.raises(WorkerError, match=rf"rank\(s\) \[1\] \(pid {group.processes[1].pid}\) sent no heartbeat "
                                              rf"for {HEARTBEAT_TIMEOUT_S:g} s"):
            group.call("ranks", [(torch.tensor([1.0]),)] * 2)
        assert group.check() == group.broken and "sent no heartbeat" in group.broken
    finally:
        os.kill(group.processes[1].pid, signal.SIGCONT)
        group.close()
    assert not any(process.is_alive() for process in group.processes)
