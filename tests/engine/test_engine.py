"""The engine with the real tiny Qwen-Image pipeline: modes, streams, abort, close, fault isolation."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engine_lib.config import EngineConfig
from engine_lib.engine import DiffusionEngine, EngineMode
from engine_lib.request import (
    ConfigError,
    EngineUnavailableError,
    InvalidInputError,
    RequestCancelledError,
    SamplingParams,
)

MODES = [
    pytest.param(False, 1, id="request-serial"),
    pytest.param(False, 4, id="request-fused"),
    pytest.param(True, 1, id="step-serial"),
    pytest.param(True, 4, id="step-continuous"),
]


@pytest.fixture(scope="module")
def adapter(tiny_qwen_dir):
    from engine_lib.pipelines.registry import load_adapter

    return load_adapter(EngineConfig(model_path=str(tiny_qwen_dir), device="cpu", dtype="float32"))


def make(adapter, step_execution=False, max_num_seqs=1, **kw):
    config = EngineConfig(step_execution=step_execution, max_num_seqs=max_num_seqs, warmup=False, **kw)
    return DiffusionEngine(adapter, config)


def params(seed=0, steps=3, size=64, **kw):
    return SamplingParams(prompt=kw.pop("prompt", f"a red cube {seed}"), seed=seed, num_inference_steps=steps,
                          height=size, width=size, **kw)


def drain(stream, timeout=120):
    """All outputs of one stream, checking the contract: exactly one final, and it is last."""
    outputs = []
    deadline = time.monotonic() + timeout
    while True:
        outputs.append(stream.get(timeout=max(0.1, deadline - time.monotonic())))
        if outputs[-1].is_final:
            return outputs


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def assert_idle(engine):
    """No queue, stream or runner state survives finished, aborted or failed requests."""
    assert wait_until(lambda: engine.stats().num_runner_states == 0 and engine.stats().num_streams == 0)
    stats = engine.stats()
    assert (stats.num_waiting, stats.num_running, stats.num_runner_states, stats.num_streams) == (0, 0, 0, 0)


@pytest.mark.parametrize("step_execution,max_num_seqs", MODES)
def test_eight_concurrent_requests_each_end_once(adapter, step_execution, max_num_seqs):
    engine = make(adapter, step_execution, max_num_seqs)
    try:
        expected_mode = EngineMode.STEP_BATCH if step_execution else EngineMode.REQUEST_BATCH
        assert engine.mode is expected_mode
        streams = [engine.add_request(f"r{i}", params(seed=i, steps=2 + i % 3, preview_interval=1))
                   for i in range(8)]
        for i, stream in enumerate(streams):
            outputs = drain(stream)
            assert [o.is_final for o in outputs].count(True) == 1
            final = outputs[-1]
            assert final.error is None, final.error
            assert final.images.shape == (1, 64, 64, 3) and final.images.dtype == np.uint8
            steps = [o.step for o in outputs]
            assert steps == sorted(steps)
            if step_execution:  # previews at every step before the last
                assert steps == list(range(1, 2 + i % 3 + 1))
        assert_idle(engine)
    finally:
        engine.close()


def test_abort_mid_denoise_frees_state_even_when_idle(adapter):
    engine = make(adapter, step_execution=True, max_num_seqs=2)
    try:
        stream = engine.add_request("long", params(steps=200, preview_interval=1))
        first = stream.get(timeout=60)
        assert not first.is_final and first.step == 1
        assert engine.stats().num_runner_states == 1
        engine.abort(["long"])
        final = drain(stream)[-1]
        assert isinstance(final.error, RequestCancelledError)
        assert_idle(engine)
        # the engine still serves afterwards
        assert engine.add_request("next", params()).result(timeout=60).error is None
    finally:
        engine.close()


def test_abort_waiting_request(adapter):
    engine = make(adapter, step_execution=True, max_num_seqs=1)
    try:
        running = engine.add_request("running", params(steps=30))
        waiting = engine.add_request("waiting", params(seed=1, steps=3))
        engine.abort(["waiting"])
        assert isinstance(waiting.result(timeout=60).error, RequestCancelledError)
        assert running.result(timeout=120).error is None
        assert_idle(engine)
    finally:
        engine.close()


def test_close_ends_every_stream_and_joins_promptly(adapter):
    engine = make(adapter, step_execution=True, max_num_seqs=2)
    streams = [engine.add_request(f"c{i}", params(seed=i, steps=500)) for i in range(4)]
    time.sleep(0.3)
    start = time.monotonic()
    engine.close(timeout=5.0)
    assert time.monotonic() - start < 5.0
    assert not engine.stats().thread_alive
    for stream in streams:
        outputs = drain(stream, timeout=5)
        assert isinstance(outputs[-1].error, EngineUnavailableError)
    with pytest.raises(EngineUnavailableError):
        engine.add_request("late", params())


def test_queue_limit_rejects_with_unavailable(adapter):
    engine = make(adapter, step_execution=True, max_num_seqs=1, max_queue=2)
    try:
        streams = [engine.add_request("a", params(steps=100))]
        wait_until(lambda: engine.stats().num_running == 1)
        streams += [engine.add_request(i, params()) for i in ("b", "c")]
        with pytest.raises(EngineUnavailableError, match="max_queue=2"):
            engine.add_request("d", params())
        engine.abort(["a"])
        assert [s.result(timeout=60).error is None for s in streams] == [False, True, True]
    finally:
        engine.close()


def test_invalid_input_and_duplicate_id_rejected(adapter):
    engine = make(adapter, step_execution=True)
    try:
        with pytest.raises(InvalidInputError, match="height"):
            engine.add_request("bad", params(size=60))
        stream = engine.add_request("dup", params(steps=20))
        with pytest.raises(ValueError, match="already active"):
            engine.add_request("dup", params())
        assert stream.result(timeout=60).error is None
        assert_idle(engine)
    finally:
        engine.close()


class FaultyAdapter:
    """The real adapter with one injected failure for requests whose prompt is 'boom'."""

    def __init__(self, real, where):
        self._real, self._where = real, where

    def __getattr__(self, name):
        return getattr(self._real, name)

    def prepare_encode(self, state):
        if self._where == "prepare_encode" and state.params.prompt == "boom":
            raise RuntimeError("injected prepare_encode failure")
        return self._real.prepare_encode(state)

    def forward(self, batch):
        if self._where == "forward" and any(p.prompt == "boom" for p in batch.params):
            raise RuntimeError("injected forward failure")
        return self._real.forward(batch)


def max_level_diff(a, b):
    return int(np.abs(a.astype(int) - b.astype(int)).max())


@pytest.mark.parametrize("step_execution,where", [(True, "prepare_encode"), (False, "forward")])
def test_failing_request_fails_alone(adapter, step_execution, where):
    good = [params(seed=s, steps=3) for s in (1, 2, 3)]
    solo = make(adapter, step_execution=step_execution)
    try:
        references = [solo.add_request(f"s{i}", p).result(timeout=60).images for i, p in enumerate(good)]
    finally:
        solo.close()
    engine = DiffusionEngine(FaultyAdapter(adapter, where),
                             EngineConfig(step_execution=step_execution, max_num_seqs=4, warmup=False))
    try:
        streams = [engine.add_request(f"g{i}", p) for i, p in enumerate(good[:2])]
        streams.insert(1, engine.add_request("bad", params(seed=9, steps=3, prompt="boom")))
        streams.append(engine.add_request("g2", good[2]))
        finals = [s.result(timeout=120) for s in streams]
        assert "injected" in str(finals[1].error)
        for final, reference in zip(finals[:1] + finals[2:], references):
            assert final.error is None
            assert max_level_diff(final.images, reference) <= 1
        assert_idle(engine)
    finally:
        engine.close()


def test_capability_flags_checked_at_load(adapter):
    class NoStep(FaultyAdapter):
        supports_step_execution = False
        supports_request_batch = False

    with pytest.raises(ConfigError, match="step_execution=false"):
        DiffusionEngine(NoStep(adapter, None), EngineConfig(step_execution=True))
    with pytest.raises(ConfigError, match="max_num_seqs=1"):
        DiffusionEngine(NoStep(adapter, None), EngineConfig(max_num_seqs=2))


def test_make_engine_cleans_up_when_warmup_fails(adapter):
    class Broken(FaultyAdapter):
        def forward(self, batch):
            raise RuntimeError("broken pipeline")

    before = {t.name for t in threading.enumerate()}
    with pytest.raises(RuntimeError, match="warm-up failed"):
        DiffusionEngine.make_engine(EngineConfig(), adapter=Broken(adapter, None))
    assert wait_until(lambda: {t.name for t in threading.enumerate()} <= before)


def test_admission_wait_forms_one_wave(adapter):
    ticks = []
    engine = DiffusionEngine(adapter, EngineConfig(max_num_seqs=4, request_batch_max_wait_ms=2000, warmup=False),
                             tick_listener=ticks.append)
    try:
        streams = []
        for i in range(4):
            streams.append(engine.add_request(f"w{i}", params(seed=i)))
            time.sleep(0.005)
        assert all(s.result(timeout=60).error is None for s in streams)
        assert [t.batch_size for t in ticks] == [4]
    finally:
        engine.close()
