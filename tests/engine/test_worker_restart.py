"""A broken parallel worker group inside the engine: the requests whose state it held end with one final error
each, the requests still waiting run once the engine has started a new group by itself, and while a restart
keeps failing requests end UNAVAILABLE instead of hanging.

The tiny Qwen-Image adapter runs in this process; its `workers` is a test double whose "ranks" die on demand
(a real group's death and restart: tests/serving/test_parallel_serving.py).
"""

from __future__ import annotations

import functools

import pytest

from engine_lib import worker_watch
from engine_lib.config import INPUT_MAX, EngineConfig
from engine_lib.engine import DiffusionEngine
from engine_lib.hooks import EngineHooks, FileTickBudget
from engine_lib.parallel import WorkerError
from engine_lib.request import EngineUnavailableError, PipelineError
from tests.helpers.waiting import TickBudget, wait_until as wait_within

DEATH = "rank 1 (pid 4242) died with exit code -9"


class Group:
    """A worker group double: `check()` and `close()` as engine_lib/parallel.py's WorkerGroup answers them."""

    def __init__(self):
        self.broken = None

    def check(self):
        return self.broken

    def close(self):
        self.broken = self.broken or "closed"

    world_size = 2
    reports = [{"held_states": 0.0}] * 2  # what each rank's `report` answers

    def call_all(self, method, args_per_rank):
        assert method == "report"
        return self.reports


class Ranks:
    """The adapter's worker starts (each a new Group, or a failure while `failing`), and a forward hook that
    breaks the current group once `die` is set, as a rank killed mid-forward does."""

    def __init__(self, adapter):
        self.adapter, self.groups, self.failing, self.die = adapter, [], False, False

    def start(self, model_path):
        if self.failing:
            raise WorkerError("rank 0 could not join the group")
        self.groups.append(Group())
        return self.groups[-1]

    def before_forward(self, states):
        if self.die:
            self.die = False
            self.adapter.workers.broken = DEATH
            raise WorkerError(DEATH)


@pytest.fixture
def ranks(tiny_qwen_dir):
    from engine_lib.pipelines.registry import load_adapter

    adapter = load_adapter(EngineConfig.of(model_path=str(tiny_qwen_dir), device="cpu", dtype="float32"))
    ranks = Ranks(adapter)
    adapter.start_workers = ranks.start  # what the registry's load does for a parallel instance
    adapter.launch_workers(str(tiny_qwen_dir))
    return ranks


wait_until = functools.partial(wait_within, timeout=30.0)


def make(ranks, budget, ticks=None):
    config = EngineConfig.of(step_execution=True, max_num_seqs=1, warmup=False, max_preemptions=1,
                             input_max={**INPUT_MAX, "num_inference_steps": 1000})
    hooks = EngineHooks(tick_gate=FileTickBudget(str(budget.path)), before_forward=ranks.before_forward)
    return DiffusionEngine(ranks.adapter, config, hooks=hooks, tick_listener=ticks.append if ticks is not None else None)


def request(engine, rid, steps=2, priority=2):
    return engine.add_request(rid, dict(prompt=rid, seed=1, num_inference_steps=steps, height=32, width=32,
                                        priority=priority))


def finals(stream, timeout=60):
    """The stream's outputs up to its final one, and that nothing follows it."""
    outputs = [stream.get(timeout=timeout)]
    while not outputs[-1].is_final:
        outputs.append(stream.get(timeout=timeout))
    with pytest.raises(Exception):
        stream.get(timeout=0.2)
    return outputs[-1]


def test_the_requests_the_group_held_end_once_and_a_waiting_one_runs_on_the_restarted_group(ranks, tmp_path):
    budget, ticks = TickBudget(tmp_path / "budget").hold(), []
    engine = make(ranks, budget, ticks)
    try:
        paused = request(engine, "paused", steps=4)
        budget.allow(1)
        assert wait_until(lambda: len(ticks) == 1)
        urgent = request(engine, "urgent", steps=4, priority=1)  # pauses "paused" after its first step
        budget.allow(1)
        assert wait_until(lambda: len(ticks) == 2) and engine.stats().num_preempted == 1
        waiting = request(engine, "waiting")
        ranks.die = True
        budget.release()  # the urgent request's next forward kills a rank
        for stream, rid in ((urgent, "urgent"), (paused, "paused")):
            final = finals(stream)
            assert isinstance(final.error, PipelineError) and DEATH in str(final.error), rid
        assert finals(waiting).error is None
        assert len(ranks.groups) == 2 and ranks.groups[0].broken == DEATH and not ranks.groups[1].broken
        stats = engine.stats()
        assert (stats.num_waiting, stats.num_running, stats.num_runner_states, stats.num_streams) == (0, 0, 0, 0)
    finally:
        budget.release()
        engine.close()


def test_while_restarts_fail_requests_end_unavailable_then_the_model_serves_again(ranks, tmp_path, monkeypatch):
    monkeypatch.setattr(worker_watch, "RESTART_BACKOFF_S", (0.2,))
    engine = make(ranks, TickBudget(tmp_path / "budget"))
    try:
        ranks.failing = True
        ranks.adapter.workers.broken = DEATH  # a rank died while the engine was idle
        final = finals(request(engine, "meanwhile"))
        assert isinstance(final.error, EngineUnavailableError) and "could not join" in str(final.error)
        ranks.failing = False
        assert wait_until(lambda: len(ranks.groups) == 2, timeout=5)  # within one backoff wait
        assert finals(request(engine, "after")).error is None
        assert len(ranks.groups) == 2 and not ranks.adapter.workers.broken
    finally:
        engine.close()


def test_the_ranks_counters_add_up_over_the_ranks_and_the_groups_and_only_grow():
    """The metrics' counters are monotone: a new group's ranks count their recompilations from 0 again, so the
    watch keeps what the broken group had counted."""
    first, second = Group(), Group()
    first.reports = [{"held_states": 1.0, "compile_recompiles": 2.0}, {"held_states": 0.0, "compile_recompiles": 1.0}]
    second.reports = [{"held_states": 0.0, "compile_recompiles": 1.0}] * 2
    adapter = type("Adapter", (), {"name": "double", "workers": first})()
    watch = worker_watch.WorkerWatch(adapter)
    watch.count_rank_states(idle=True)
    assert watch.rank_states == 1
    assert watch.with_rank_counters({"compile_recompiles": 1.0, "prompt_cache_hits": 4.0}) == \
        {"compile_recompiles": 4.0, "prompt_cache_hits": 4.0}  # the driver's own, and the ranks'
    first.broken = DEATH
    assert watch.broke() == DEATH and watch.rank_states == 0
    adapter.restart_workers = lambda: setattr(adapter, "workers", second)
    assert watch.restart()
    watch.count_rank_states(idle=True)
    assert watch.rank_counters == {"compile_recompiles": 5.0}  # 3 before the restart, 2 since
