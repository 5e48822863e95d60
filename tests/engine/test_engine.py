"""The engine with the real tiny Qwen-Image pipeline: modes, streams, abort, close, fault isolation, parity."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from engine_lib.config import EngineConfig
from engine_lib.engine import DiffusionEngine, EngineMode
from engine_lib.interface import to_uint8
from engine_lib.request import ConfigError, EngineUnavailableError, InvalidInputError, RequestCancelledError

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
    kw.setdefault("max_steps", 1000)  # some tests need a request that outlasts their checks
    config = EngineConfig(step_execution=step_execution, max_num_seqs=max_num_seqs, warmup=False, **kw)
    return DiffusionEngine(adapter, config)


def params(seed=0, steps=3, size=64, **kw):
    """A request's inputs by name; the engine validates them at admission."""
    return dict(prompt=kw.pop("prompt", f"a red cube {seed}"), seed=seed, num_inference_steps=steps,
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
            assert final.outputs["image"].shape == (1, 64, 64, 3) and final.outputs["image"].dtype == np.uint8
            # Both modes run the one step loop: a preview at every step before the last, then the final.
            assert [o.step for o in outputs] == list(range(1, 2 + i % 3 + 1))
            assert all(o.outputs["image"].shape == (1, 64, 64, 3) for o in outputs)
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
        finals = [s.result(timeout=120) for s in streams]
        assert f"injected {where}" in str(finals[1].error)
        for final, reference in zip(finals[:1] + finals[2:], references):
            assert final.error is None
            assert max_level_diff(final.outputs["image"], reference) <= 1
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
        def denoise_step(self, input_batch, *, states):
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
        assert [t.batch_size for t in ticks] == [4, 4, 4]  # one wave of four, one tick per denoise step
    finally:
        engine.close()


def test_request_mode_aborts_at_a_step_boundary(adapter):
    """A wave runs step by step, so an abort frees its member at once and the others go on."""
    engine = make(adapter, step_execution=False, max_num_seqs=2)
    try:
        doomed = engine.add_request("doomed", params(steps=200, preview_interval=1))
        mate = engine.add_request("mate", params(seed=1, steps=200))
        assert not doomed.get(timeout=60).is_final  # the wave is running
        engine.abort(["doomed"])
        assert isinstance(drain(doomed)[-1].error, RequestCancelledError)
        assert wait_until(lambda: engine.stats().num_runner_states == 1)  # freed long before the mate ends
        assert mate.result(timeout=120).error is None
        assert_idle(engine)
    finally:
        engine.close()


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
            levels = np.abs(image.astype(int) - reference.astype(int))
            assert levels.max() <= 1 and (levels > 0).mean() <= 0.001
    finally:
        engine.close()
