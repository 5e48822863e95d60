"""The load generator's loops against an in-process stand-in for a server (no Triton): every request sent once,
the closed loop at most `concurrency` at a time and all of them at once when it can, the open loop never before a
request's arrival, and a client's failure raised to the caller with every client closed.

No timing is asserted: the stand-in counts requests in flight, and arrivals are compared with sends, which the
loop orders whatever the machine's speed."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import replace

import pytest

from benchmarks import loadgen, workloads

SPECS = [replace(spec, prompt=f"request {i}") for i, spec in enumerate(workloads.generate(9, (64, 96), (3,), seed=7))]


class FakeTarget:
    """Opens clients that answer each request at once (after `barrier`, for the first ones), counting those in
    flight; a request whose prompt is `fail_prompt` raises."""

    def __init__(self, barrier=None, fail_prompt: str = ""):
        self.barrier, self.fail_prompt = barrier, fail_prompt
        self.lock, self.in_flight, self.most_in_flight = threading.Lock(), 0, 0
        self.sent, self.closed, self.opened = [], 0, 0

    def open(self) -> "FakeTarget":
        self.opened += 1
        return self

    def close(self) -> None:
        with self.lock:
            self.closed += 1

    def run(self, record):
        record.sent = time.perf_counter()
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.sent.append(record.spec.prompt)
        try:
            if record.spec.prompt == self.fail_prompt:
                raise RuntimeError(f"refused {record.spec.prompt}")
            if self.barrier is not None and len(self.sent) <= self.barrier.parties:
                self.barrier.wait(timeout=30)
            record.done = time.perf_counter()
        finally:
            with self.lock:
                self.in_flight -= 1
        return record


def test_the_closed_loop_sends_each_request_once_with_every_client_busy_and_never_more():
    target = FakeTarget(barrier=threading.Barrier(3))
    run = loadgen.run_closed_loop(target, SPECS, concurrency=3, tag="c", pause_s=0.01)
    assert sorted(target.sent) == sorted(s.prompt for s in SPECS)
    assert sorted(r.request_id for r in run.records) == sorted(f"c-{i}" for i in range(len(SPECS)))
    assert target.most_in_flight == 3 and (target.opened, target.closed) == (3, 3)


def test_the_closed_loop_stops_when_an_endless_workload_does():
    target, stop = FakeTarget(), threading.Event()

    def endless():
        for i in itertools.count():
            if i == 7:
                stop.set()
            yield replace(SPECS[0], seed=i)

    run = loadgen.run_closed_loop(target, itertools.takewhile(lambda _: not stop.is_set(), endless()), 2)
    assert len(run.records) == 7 and {r.spec.seed for r in run.records} == set(range(7))


def test_the_open_loop_sends_no_request_before_its_arrival_and_counts_latency_from_it():
    target = FakeTarget()
    run = loadgen.run_open_loop(target, SPECS, rate=60.0, seed=3, max_outstanding=4)
    assert sorted(target.sent) == sorted(s.prompt for s in SPECS)
    arrivals = [r.scheduled for r in run.records]
    assert arrivals == sorted(arrivals) and len(set(arrivals)) == len(SPECS)
    assert all(r.sent >= r.scheduled and r.latency == r.done - r.scheduled for r in run.records)
    assert (target.opened, target.closed) == (4, 4)


@pytest.mark.parametrize("loop", ["closed", "open"])
def test_a_client_failure_is_raised_and_every_client_is_closed(loop):
    target = FakeTarget(fail_prompt="request 4")
    with pytest.raises(RuntimeError, match="refused request 4"):
        if loop == "closed":
            loadgen.run_closed_loop(target, SPECS, concurrency=2)
        else:
            loadgen.run_open_loop(target, SPECS, rate=200.0, max_outstanding=2)
    assert (target.opened, target.closed) == (2, 2)
