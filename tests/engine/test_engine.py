"""The engine with the real tiny Qwen-Image pipeline: modes, streams, abort, close, fault isolation, parity."""

from __future__ import annotations

import functools
import queue
import threading
import time

import numpy as np
import pytest
import torch

from engine_lib.config import INPUT_MAX, ConfigError, EngineConfig
from engine_lib.engine import DiffusionEngine, EngineMode
from engine_lib.hooks import EngineHooks, FailPrompt
from engine_lib.interface import to_uint8
from engine_lib.pipelines.capabilities import Capabilities
from engine_lib.request import EngineUnavailableError, InvalidInputError, PipelineError, RequestCancelledError
from engine_lib.sched import scheduler
from tests.helpers.parity_checks import assert_within_one_level
from tests.helpers.waiting import wait_until as wait_within

MODES = [
    pytest.param(False, 1, id="request-serial"),
    pytest.param(False, 4, id="request-fused"),
    pytest.param(True, 1, id="step-serial"),
    pytest.param(True, 4, id="step-continuous"),
]


@pytest.fixture(scope="module")
def adapter(tiny_qwen_dir):
    from engine_lib.pipelines.registry import load_adapter

    return load_adapter(EngineConfig.of(model_path=str(tiny_qwen_dir), device="cpu", dtype="float32"))


def make(adapter, step_execution=False, max_num_seqs=1, hooks=None, **kw):
    config = EngineConfig.of(step_execution=step_execution, max_num_seqs=max_num_seqs, warmup=False,
                             input_max={**INPUT_MAX, "num_inference_steps": 1000},  # requests that outlast their checks
                             **kw)
    return DiffusionEngine(adapter, config, hooks=hooks)


def params(seed=0, steps=3, size=64, **kw):
    """A request's inputs by name; the engine validates them at admission."""
    return dict(prompt=kw.pop("prompt", f"a red cube {seed}"), seed=seed, num_inference_steps=steps,
                height=size, width=size, **kw)


def drain(stream, timeout=120):
    """The outputs of one stream up to its final one (`assert_ended` then checks nothing follows it)."""
    outputs = []
    deadline = time.monotonic() + timeout
    while True:
        outputs.append(stream.get(timeout=max(0.1, deadline - time.monotonic())))
        if outputs[-1].is_final:
            return outputs


wait_until = functools.partial(wait_within, timeout=10.0)


def assert_idle(engine):
    """No queue, stream or runner state survives finished, aborted or failed requests."""
    assert wait_until(lambda: engine.stats().num_runner_states == 0 and engine.stats().num_streams == 0)
    stats = engine.stats()
    assert (stats.num_waiting, stats.num_running, stats.num_runner_states, stats.num_streams) == (0, 0, 0, 0)


def assert_ended(engine, *streams):
    """Exactly one final per stream: once the engine is idle, nothing arrived after the final one."""
    assert_idle(engine)
    for stream in streams:
        with pytest.raises(queue.Empty):
            extra = stream.get(timeout=0)
            pytest.fail(f"{stream.request_id}: an output after the final one: {extra}")


def run_held(engine, budget, waiting: int, ticks: int) -> None:
    """Once `waiting` requests wait (added while the engine was held), let exactly `ticks` ticks run."""
    assert wait_until(lambda: engine.stats().num_waiting == waiting), engine.stats()
    budget.allow(ticks)


def first_output(stream, timeout=60):
    output = stream.get(timeout=timeout)
    assert not output.is_final, output.error
    return output


@pytest.mark.parametrize("step_execution,max_num_seqs", MODES)
def test_eight_concurrent_requests_each_end_once(adapter, step_execution, max_num_seqs):
    engine = make(adapter, step_execution, max_num_seqs)
    try:
        expected_mode = EngineMode.STEP_BATCH if step_execution else EngineMode.REQUEST_BATCH
        assert engine.mode is expected_mode
        streams = [engine.add_request(f"r{i}", params(seed=i, steps=2 + i % 3, preview_interval=1))
                   for i in range(8)]
        outputs_of = [drain(stream) for stream in streams]
        assert_ended(engine, *streams)
        for i, outputs in enumerate(outputs_of):
            final = outputs[-1]
            assert final.error is None, final.error
            assert final.outputs["image"].shape == (1, 64, 64, 3) and final.outputs["image"].dtype == np.uint8
            # Both modes run the one step loop: a preview at every step before the last, then the final.
            assert [o.step for o in outputs] == list(range(1, 2 + i % 3 + 1))
            assert all(o.outputs["image"].shape == (1, 64, 64, 3) for o in outputs)
        assert_idle(engine)
    finally:
        engine.close()


def test_abort_mid_denoise_frees_state_even_when_idle(adapter, tick_budget):
    engine = make(adapter, step_execution=True, max_num_seqs=2, hooks=tick_budget.hooks())
    try:
        tick_budget.allow(1)  # one step, then the engine holds: the request is mid-denoise, and stays so
        stream = engine.add_request("long", params(steps=5, preview_interval=1))
        assert first_output(stream).step == 1
        assert wait_until(lambda: tick_budget.left() == 0) and engine.stats().num_runner_states == 1
        engine.abort(["long"])
        final = drain(stream)[-1]
        assert isinstance(final.error, RequestCancelledError) and final.step == 1
        assert_ended(engine, stream)
        tick_budget.release()
        assert engine.add_request("next", params()).result(timeout=60).error is None  # it still serves
    finally:
        engine.close()


def test_abort_waiting_request(adapter, tick_budget):
    engine = make(adapter, step_execution=True, max_num_seqs=1, hooks=tick_budget.hooks())
    try:
        tick_budget.allow(1)  # admits "running" alone (capacity 1), one step, then holds
        running = engine.add_request("running", params(steps=3, preview_interval=1))
        waiting = engine.add_request("waiting", params(seed=1, steps=3))
        assert first_output(running).step == 1
        assert engine.stats().num_waiting == 1
        engine.abort(["waiting"])
        assert isinstance(drain(waiting)[-1].error, RequestCancelledError)
        tick_budget.release()
        assert drain(running)[-1].error is None
        assert_ended(engine, running, waiting)
    finally:
        engine.close()


def test_close_ends_every_stream_and_joins_promptly(adapter, tick_budget):
    engine = make(adapter, step_execution=True, max_num_seqs=2, hooks=tick_budget.hooks())
    tick_budget.hold()
    streams = [engine.add_request(f"c{i}", params(seed=i, steps=5, preview_interval=1)) for i in range(4)]
    run_held(engine, tick_budget, waiting=4, ticks=1)  # two run one step, two wait; then it holds, all open
    assert [first_output(s).step for s in streams[:2]] == [1, 1]
    assert engine.stats().num_waiting == 2
    start = time.monotonic()
    engine.close(timeout=5.0)
    assert time.monotonic() - start < 5.0
    assert not engine.stats().thread_alive
    for stream in streams:
        outputs = drain(stream, timeout=5)
        assert isinstance(outputs[-1].error, EngineUnavailableError)
        with pytest.raises(queue.Empty):
            stream.get(timeout=0)
    assert engine.stats().num_streams == 0 and engine.stats().num_runner_states == 0
    with pytest.raises(EngineUnavailableError):
        engine.add_request("late", params())


def test_queue_limit_rejects_with_unavailable(adapter, tick_budget):
    engine = make(adapter, step_execution=True, max_num_seqs=1, max_queue=2,
                  hooks=tick_budget.hooks())
    try:
        tick_budget.allow(1)
        streams = [engine.add_request("a", params(steps=3, preview_interval=1))]
        assert first_output(streams[0]).step == 1  # "a" runs; the engine holds
        streams += [engine.add_request(i, params()) for i in ("b", "c")]
        with pytest.raises(EngineUnavailableError, match="max_queue=2"):
            engine.add_request("d", params())
        engine.abort(["a"])
        tick_budget.release()
        assert [drain(s)[-1].error is None for s in streams] == [False, True, True]
        assert_ended(engine, *streams)
    finally:
        engine.close()


def test_invalid_input_and_duplicate_id_rejected(adapter, tick_budget):
    engine = make(adapter, step_execution=True, hooks=tick_budget.hooks())
    try:
        with pytest.raises(InvalidInputError, match="height"):
            engine.add_request("bad", params(size=60))
        tick_budget.hold()  # "dup" stays active until released
        stream = engine.add_request("dup", params(steps=2))
        with pytest.raises(ValueError, match="already active"):
            engine.add_request("dup", params())
        tick_budget.release()
        assert drain(stream)[-1].error is None
        assert_ended(engine, stream)
    finally:
        engine.close()


class FaultyAdapter:
    """The real adapter with one injected failure, in one contract method, for requests whose prompt is 'boom'.

    Batched methods fail the whole call when a 'boom' request is in it, as a real
    failure of a batched forward or decode would.
    """

    def __init__(self, real, where):
        self._real, self._where = real, where

    def __getattr__(self, name):
        return getattr(self._real, name)

    def _maybe_fail(self, where, states):
        if self._where == where and any(s.params.prompt == "boom" for s in states):
            raise RuntimeError(f"injected {where} failure")

    def prepare_encode(self, state):
        self._maybe_fail("prepare_encode", [state])
        return self._real.prepare_encode(state)

    def denoise_step(self, input_batch, *, states):
        self._maybe_fail("denoise_step", states)
        return self._real.denoise_step(input_batch, states=states)

    def step_scheduler(self, state, noise_pred):
        self._maybe_fail("step_scheduler", [state])
        return self._real.step_scheduler(state, noise_pred)

    def step_batch(self, input_batch, states, prediction):  # the same step, batched: the runner falls back
        self._maybe_fail("step_scheduler", states)
        return self._real.step_batch(input_batch, states, prediction)

    def post_decode(self, states):
        self._maybe_fail("post_decode", states)
        return self._real.post_decode(states)


def max_level_diff(a, b):
    return int(np.abs(a.astype(int) - b.astype(int)).max())


@pytest.mark.parametrize("where", ["prepare_encode", "denoise_step", "step_scheduler", "post_decode"])
@pytest.mark.parametrize("step_execution", [False, True], ids=["request-mode", "step-mode"])
def test_failing_request_fails_alone(adapter, step_execution, where):
    good = [params(seed=s, steps=3) for s in (1, 2, 3)]
    solo = make(adapter, step_execution=step_execution)
    try:
        references = [solo.add_request(f"s{i}", p).result(timeout=60).outputs["image"] for i, p in enumerate(good)]
    finally:
        solo.close()
    engine = make(FaultyAdapter(adapter, where), step_execution=step_execution, max_num_seqs=4)
    try:
        streams = [engine.add_request(f"g{i}", p) for i, p in enumerate(good[:2])]
        streams.insert(1, engine.add_request("bad", params(seed=9, steps=3, prompt="boom")))
        streams.append(engine.add_request("g2", good[2]))
        finals = [drain(s)[-1] for s in streams]
        assert f"injected {where}" in str(finals[1].error)
        for final, reference in zip(finals[:1] + finals[2:], references):
            assert final.error is None
            assert max_level_diff(final.outputs["image"], reference) <= 1
        assert_ended(engine, *streams)
    finally:
        engine.close()


def test_capability_flags_checked_at_load(adapter):
    class NoStep(FaultyAdapter):
        capabilities = Capabilities(frozenset())  # neither step execution nor request batches

    with pytest.raises(ConfigError, match="'step_execution'=true: .* does not run step execution"):
        DiffusionEngine(NoStep(adapter, None), EngineConfig.of(step_execution=True))
    with pytest.raises(ConfigError, match="'max_num_seqs'=2: .* does not run request batch"):
        DiffusionEngine(NoStep(adapter, None), EngineConfig.of(max_num_seqs=2))


def test_make_engine_cleans_up_when_warmup_fails(adapter):
    class Broken(FaultyAdapter):
        def denoise_step(self, input_batch, *, states):
            raise RuntimeError("broken pipeline")

    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="warm-up failed"):
        DiffusionEngine.make_engine(EngineConfig(), adapter=Broken(adapter, None))
    assert wait_until(lambda: set(threading.enumerate()) <= before), set(threading.enumerate()) - before


def test_make_engine_loads_the_pipeline_on_a_thread_that_ends(adapter, monkeypatch):
    """Not on the caller's thread (Triton's stub main thread), so no OpenMP team stays there (make_engine)."""
    from engine_lib.pipelines import registry

    loaded_on = []
    monkeypatch.setattr(registry, "load_adapter", lambda config: loaded_on.append(threading.current_thread()) or adapter)
    engine = DiffusionEngine.make_engine(EngineConfig.of(warmup=False))
    try:
        assert engine.adapter is adapter
        assert loaded_on[0] is not threading.current_thread() and not loaded_on[0].is_alive()
    finally:
        engine.close()


def test_make_engine_raises_the_loading_error_itself(monkeypatch):
    from engine_lib.pipelines import registry

    def broken(config):
        raise ConfigError("parameter 'model_path': no such folder")

    monkeypatch.setattr(registry, "load_adapter", broken)
    with pytest.raises(ConfigError, match="model_path"):
        DiffusionEngine.make_engine(EngineConfig.of(warmup=False))


def test_request_mode_waits_for_a_burst_and_runs_it_as_one_wave(adapter, monkeypatch):
    """With a max wait the first request waits for arrivals (the scheduler's decision, unit-tested with a fake
    clock in tests/sched); the burst runs as one wave of four, one tick per denoise step."""
    monkeypatch.setattr(scheduler, "BURST_STABLE_S", 60.0)  # only a full wave (or the 60 s limit) ends the wait
    ticks = []
    engine = DiffusionEngine(adapter, EngineConfig.of(max_num_seqs=4, request_batch_max_wait_ms=60000, warmup=False),
                             tick_listener=ticks.append)
    try:
        plans, decided, schedule = [], threading.Event(), engine.scheduler.schedule

        def observed_schedule():
            plans.append(schedule())
            decided.set()
            return plans[-1]

        monkeypatch.setattr(engine.scheduler, "schedule", observed_schedule)
        streams = [engine.add_request("w0", params(seed=0))]
        assert decided.wait(10), "the engine looked at the lone request"
        assert plans[0].is_empty and ticks == [], "and chose to wait for the burst"
        streams += [engine.add_request(f"w{i}", params(seed=i)) for i in range(1, 4)]
        assert all(drain(s)[-1].error is None for s in streams)
        assert [t.batch_size for t in ticks] == [4, 4, 4]
        assert_ended(engine, *streams)
    finally:
        engine.close()


def test_request_mode_aborts_at_a_step_boundary(adapter, tick_budget):
    """A wave runs step by step, so an abort frees its member at once and the others go on."""
    engine = make(adapter, step_execution=False, max_num_seqs=2, hooks=tick_budget.hooks())
    try:
        tick_budget.hold()
        doomed = engine.add_request("doomed", params(steps=4, preview_interval=1))
        mate = engine.add_request("mate", params(seed=1, steps=4, preview_interval=1))
        run_held(engine, tick_budget, waiting=2, ticks=1)  # the wave of two runs one step, then holds
        assert first_output(doomed).step == 1 and first_output(mate).step == 1
        engine.abort(["doomed"])
        assert isinstance(drain(doomed)[-1].error, RequestCancelledError)
        assert wait_until(lambda: engine.stats().num_runner_states == 1)  # freed while the mate still runs
        tick_budget.release()
        assert drain(mate)[-1].error is None
        assert_ended(engine, doomed, mate)
    finally:
        engine.close()


def test_an_injected_failure_fails_its_request_alone(adapter):
    """An injected failure (engine_lib/hooks.py): the request fails in the batched denoise step with INTERNAL,
    its batch-mates finish."""
    engine = make(adapter, step_execution=True, max_num_seqs=4, hooks=EngineHooks(before_forward=FailPrompt("boom")))
    try:
        streams = [engine.add_request(f"g{i}", params(seed=i)) for i in range(3)]
        streams.insert(1, engine.add_request("bad", params(prompt="boom")))
        finals = [drain(s)[-1] for s in streams]
        assert isinstance(finals[1].error, PipelineError) and finals[1].error.code == "INTERNAL"
        assert "injected failure" in str(finals[1].error)
        assert all(f.error is None for f in finals[:1] + finals[2:])
        assert_ended(engine, *streams)
    finally:
        engine.close()


def test_step_is_one_tick_that_a_caller_drives(adapter):
    """Without its thread the engine runs nothing until `step()`; each call is one tick: schedule (a request
    submitted before it joins at it), one denoise step over the running set, update, emit (previews, then one
    final per request). The finals equal the threaded engine's images."""
    engine = DiffusionEngine(adapter, EngineConfig.of(step_execution=True, max_num_seqs=2, warmup=False),
                             run_loop=False)
    first = engine.add_request("first", params(seed=1, steps=3, preview_interval=2, num_images=2))
    stats = engine.stats()
    assert not stats.thread_alive and (stats.num_waiting, stats.num_running) == (1, 0)
    plan0, out0 = engine.step()
    second = engine.add_request("second", params(seed=2, steps=2, num_images=2))
    plan1, out1 = engine.step()
    assert plan0.new_ids == ["first"] and plan1.new_ids == ["second"] and plan1.running_ids == ["first"]
    assert (out0.forward_size, out1.forward_size) == (1, 2) and out1.step_index == {"first": 2, "second": 1}
    plan, out = engine.step()
    assert plan.running_ids == ["first", "second"] and out.forward_size == 2 and out.finished == {"first", "second"}
    assert engine.step()[0].is_empty and not engine.scheduler.has_requests
    first_outputs, second_outputs = drain(first, timeout=1), drain(second, timeout=1)  # all there: the steps emitted
    assert [(o.step, o.is_final) for o in first_outputs] == [(2, False), (3, True)]
    assert [(o.step, o.is_final) for o in second_outputs] == [(2, True)]
    assert first_outputs[0].outputs["image"].shape == (2, 64, 64, 3)
    threaded = make(adapter, step_execution=True, max_num_seqs=2)
    try:
        for final, inputs in ((first_outputs[-1], params(seed=1, steps=3, num_images=2)),
                              (second_outputs[-1], params(seed=2, steps=2, num_images=2))):
            image = threaded.add_request(final.request_id, inputs).result(timeout=60).outputs["image"]
            assert final.outputs["image"].shape == image.shape
            assert np.abs(final.outputs["image"].astype(int) - image.astype(int)).max() <= 1
    finally:
        threaded.close()


@pytest.mark.parametrize("step_execution,max_num_seqs", MODES)
def test_every_mode_gives_the_diffusers_image(adapter, step_execution, max_num_seqs):
    """A request alone is bitwise `pipe(...)`'s image in every mode; four at once stay within 1 level."""
    engine = make(adapter, step_execution, max_num_seqs)
    try:
        requests = [params(seed=s, steps=3 + s % 2, prompt=f"a photo of a cat {s}") for s in range(4)]
        expected = []
        for p in requests:
            pipe_out = adapter.pipe(p["prompt"], height=64, width=64, num_inference_steps=p["num_inference_steps"],
                                    generator=torch.Generator().manual_seed(p["seed"]), output_type="np")
            expected.append(to_uint8(pipe_out.images))
        solo = engine.add_request("solo", requests[0]).result(timeout=60).outputs["image"]
        np.testing.assert_array_equal(solo, expected[0])
        streams = [engine.add_request(f"r{i}", p) for i, p in enumerate(requests)]
        for stream, reference in zip(streams, expected):
            image = stream.result(timeout=60).outputs["image"]
            assert_within_one_level(image, reference)
    finally:
        engine.close()


def test_a_tick_with_nothing_to_run_takes_nothing_from_the_budget(adapter, tick_budget):
    """An abort that leaves the engine idle wakes its loop; that wake-up must not spend the next request's tick."""
    engine = make(adapter, step_execution=True, hooks=tick_budget.hooks())
    try:
        tick_budget.allow(1)
        first = engine.add_request("first", params(steps=3, preview_interval=1))
        assert first_output(first).step == 1
        engine.abort(["first"])  # aborted before any tick is allowed again (allowing first would race a step)
        assert isinstance(drain(first)[-1].error, RequestCancelledError)
        assert_idle(engine)
        tick_budget.allow(1)
        for name in ("no-such-request", "nor-this-one"):  # each wakes the idle loop with nothing to run; the loop
            engine.abort([name])  # reads the second only once it is through its turn for the first
            assert wait_until(lambda: not engine._pending_aborts)
        assert tick_budget.left() == 1
        second = engine.add_request("second", params(steps=3, preview_interval=1))
        assert first_output(second).step == 1
        tick_budget.release()
        assert drain(second)[-1].error is None
    finally:
        engine.close()


@pytest.mark.parametrize("parameters, expected", [({}, "arrival"),
                                                  ({"scheduling_policy": "separate_priorities"}, "separate_priorities")])
def test_the_scheduling_policy_reaches_the_scheduler(adapter, parameters, expected):
    engine = make(adapter, step_execution=True, max_num_seqs=2, **parameters)
    try:
        assert engine.scheduler.policy.name == expected and engine.scheduler.step_batching
    finally:
        engine.close()


def test_an_unknown_scheduling_policy_fails_the_load_naming_it():
    with pytest.raises(ConfigError, match="'scheduling_policy'.*arrival, shortest_remaining"):
        EngineConfig.from_parameters({"scheduling_policy": "srpt"})
