"""Long ticks: a cancel (or close) stops a tick between two blocks of its forward when every request in it is
cancelled, and a tick shared with a request still wanted runs on for it.

The engine runs a test double whose denoise forward is 40 blocks (identity modules in a ModuleList, as a
transformer's blocks are), made slow by `SlowPrompt` (engine_lib/hooks.py): one forward of a slow request
takes 20 s, so a request that ends within 2 s of its cancel was stopped inside its tick. A forward hook on each
block counts the blocks that ran, so a stop that skips the boundary hook but lets the blocks run is seen.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest
import torch

from engine_lib import interface
from engine_lib.config import EngineConfig
from engine_lib.engine import DiffusionEngine
from engine_lib.hooks import EngineHooks, SlowPrompt
from engine_lib.interface import OutputSpec
from engine_lib.pipelines.base import PipelineAdapter, RequestState
from engine_lib.request import EngineUnavailableError, RequestCancelledError
from engine_lib.runner import BlockBoundaries, TickInterrupted

BLOCKS = 40


class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Identity() for _ in range(BLOCKS))
        self.ran = 0  # blocks that ran (a forward hook counts each block's forward that completed)
        for block in self.blocks:
            block.register_forward_hook(self._count)

    def _count(self, module, args, output) -> None:
        self.ran += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@dataclass
class BlocksState(RequestState):
    latents: Optional[torch.Tensor] = None

    @property
    def num_rows(self) -> int:
        return 1

    def step_inputs(self) -> dict[str, torch.Tensor]:
        return {"latents": self.latents}


class BlocksAdapter(PipelineAdapter):
    """A pipeline whose denoise forward is `Blocks`: each step runs its 40 blocks once over every row."""

    name = "blocks"
    inputs = (interface.PROMPT, interface.NUM_INFERENCE_STEPS)
    outputs = (OutputSpec("steps", "FP32", (1,), "denoise steps run"),)
    state_class = BlocksState

    @classmethod
    def load(cls, model_path, device, dtype, config=None):
        raise NotImplementedError

    def prepare_encode(self, state: BlocksState) -> None:
        state.latents = torch.zeros(1, 4)

    def denoise_step(self, input_batch, *, states):
        return self.pipe.transformer(input_batch["latents"])

    def step_scheduler(self, state: BlocksState, noise_pred) -> None:
        state.latents = state.latents + noise_pred
        state.step_index += 1

    def post_decode(self, states):
        return [{"steps": np.array([s.step_index], dtype=np.float32)} for s in states]


class Pipe:
    def __init__(self):
        self.transformer = Blocks()


def engine(before_block=None, tick_gate=None, **config) -> DiffusionEngine:
    adapter = BlocksAdapter(Pipe(), torch.device("cpu"), torch.float32)
    return DiffusionEngine(adapter, EngineConfig.of(pipeline="blocks", warmup=False, **config),
                           hooks=EngineHooks(tick_gate=tick_gate, before_block=before_block))


def blocks_run(eng: DiffusionEngine) -> int:
    return eng.runner.adapter.pipe.transformer.ran


def wait_for(predicate, timeout=10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_cancel_stops_a_20_s_tick_within_2_s_and_the_next_request_is_served():
    slow = SlowPrompt("slow", 0.5)  # 40 blocks: 20 s per forward
    eng = engine(before_block=slow)
    try:
        stream = eng.add_request("long", {"prompt": "slow", "num_inference_steps": 1})
        wait_for(lambda: slow.blocks >= 2)  # inside the forward
        cancelled_at, ran = time.monotonic(), blocks_run(eng)
        eng.abort(["long"])
        final = stream.result(timeout=5)
        assert time.monotonic() - cancelled_at < 2.0
        assert isinstance(final.error, RequestCancelledError)
        assert slow.blocks < 8, "the forward ran on after the cancel"
        assert blocks_run(eng) - ran <= 1, "blocks ran after the cancel"
        after = eng.add_request("next", {"prompt": "quick", "num_inference_steps": 2}).result(timeout=10)
        assert after.error is None and after.outputs["steps"][0] == 2
        stats = eng.stats()
        assert (stats.num_running, stats.num_runner_states, stats.num_streams) == (0, 0, 0)
    finally:
        eng.close()


def test_close_stops_a_long_tick_and_ends_its_request_unavailable():
    slow = SlowPrompt("slow", 0.5)
    eng = engine(before_block=slow)
    stream = eng.add_request("long", {"prompt": "slow", "num_inference_steps": 1})
    wait_for(lambda: slow.blocks >= 2)
    started = time.monotonic()
    eng.close()
    assert time.monotonic() - started < 2.0
    assert isinstance(stream.result(timeout=1).error, EngineUnavailableError)
    assert not eng.stats().thread_alive and eng.stats().num_runner_states == 0


class AbortAtBlock:
    """Counts block boundaries; at boundary `at` of the first tick it aborts `ids` from inside the forward."""

    def __init__(self, at: int, ids: list[str]):
        self.at, self.ids, self.blocks, self.engine = at, ids, 0, None

    def __call__(self, requests: list) -> None:
        self.blocks += 1
        if self.blocks == self.at:
            self.engine.abort(self.ids)


def run_two(abort_ids: list[str]):
    """Two 2-step requests sharing every forward (step mode), the first tick's forward aborting `abort_ids` at
    its 5th block: (their finals by id, block boundaries passed, blocks that ran)."""
    hook, go = AbortAtBlock(5, abort_ids), threading.Event()
    eng = engine(before_block=hook, tick_gate=go.is_set, step_execution=True, max_num_seqs=2)
    hook.engine = eng
    try:
        streams = {rid: eng.add_request(rid, {"prompt": rid, "num_inference_steps": 2}) for rid in ("a", "b")}
        go.set()
        finals = {rid: stream.result(timeout=30) for rid, stream in streams.items()}
        wait_for(lambda: eng.stats().num_runner_states == 0)
        return finals, hook.blocks, blocks_run(eng)
    finally:
        eng.close()


def test_a_partly_cancelled_forward_runs_on_for_the_others():
    finals, boundaries, ran = run_two(["a"])
    assert isinstance(finals["a"].error, RequestCancelledError)
    assert finals["b"].error is None and finals["b"].outputs["steps"][0] == 2
    assert boundaries == ran == 2 * BLOCKS  # both of b's forwards ran whole (the first one with a in it)


def test_a_forward_whose_requests_are_all_cancelled_stops_at_the_next_block():
    finals, boundaries, ran = run_two(["a", "b"])
    assert all(isinstance(f.error, RequestCancelledError) for f in finals.values())
    assert (boundaries, ran) == (5, 4)  # the 5th block's boundary stopped it: blocks 1-4 ran


def test_the_hooks_of_another_runner_stay_inert():
    """A second engine over the same adapter: the first one's hooks (its interrupt set by its close) stay on
    the shared blocks while its runner lives, and never stop the second one's ticks."""
    adapter = BlocksAdapter(Pipe(), torch.device("cpu"), torch.float32)
    first = DiffusionEngine(adapter, EngineConfig.of(pipeline="blocks", warmup=False))
    first.close()
    second = DiffusionEngine(adapter, EngineConfig.of(pipeline="blocks", warmup=False))
    try:
        assert second.add_request("r", {"prompt": "p", "num_inference_steps": 2}).result(timeout=10).error is None
    finally:
        second.close()
    assert first.runner is not None  # alive until here


def test_on_cuda_the_host_runs_at_most_two_blocks_ahead_of_the_device():
    """A CUDA host only queues kernels: each boundary records a device event and waits for the one two
    boundaries back, so a stop lands within two blocks of device time (fake events stand in for the GPU's)."""
    waited, numbers = [], itertools.count()

    class Event:
        def __init__(self):
            self.number = next(numbers)

        def synchronize(self):
            waited.append(self.number)

    blocks, interrupt = Blocks(), threading.Event()
    boundaries = BlockBoundaries([blocks], interrupt, None, torch.device("cuda"), device_event=lambda device: Event())
    blocks(torch.zeros(1))  # outside a tick: inert
    assert waited == [] and next(numbers) == 0
    boundaries.start([])
    blocks(torch.zeros(1))
    assert waited == list(range(1, BLOCKS - 1))  # 40 events recorded (1..40), each waited for two blocks later
    interrupt.set()
    with pytest.raises(TickInterrupted):
        blocks(torch.zeros(1))
    boundaries.end()
    blocks(torch.zeros(1))
    boundaries.remove()
