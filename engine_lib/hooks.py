"""Objects tests inject into an engine, so that "still running" and "fails alone" are facts, not timing hopes.

None of them is configuration: an engine gets them through `EngineHooks` (in-process tests), and
a served model gets them only when tritonserver was started with `DIFFUSION_TEST_HOOKS` in its
environment, a JSON object mapping a model name to its hooks, e.g.
`{"qwen_image": {"tick_budget_path": "/tmp/x/budget", "fail_prompt": "boom", "nan_prompt": "diverge"}}`
(and `"slow_prompt": "...", "slow_block_s": 1.0`: SlowPrompt).
A production server never sets it, and its engine then runs no hook at all.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from engine_lib.request import PipelineError

ENVIRONMENT = "DIFFUSION_TEST_HOOKS"


@dataclass(frozen=True)
class EngineHooks:
    """tick_gate: asked before each tick that has requests to run; False: not yet (the engine asks again
    shortly; aborts and close still act at once). before_forward: called with the states of each denoise
    forward; raising fails that forward as a pipeline error would. before_block: called with the tick's
    requests at each block boundary of its modules (engine_lib/runner.py), where a cancel stops a tick."""

    tick_gate: Optional[Callable[[], bool]] = None
    before_forward: Optional[Callable[[list], None]] = None
    before_block: Optional[Callable[[list], None]] = None


class FileTickBudget:
    """A tick gate another process can steer: the file holds how many ticks may still run (each allowed
    tick takes one); at 0 the engine waits. No file: every tick is allowed."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self) -> bool:
        try:
            budget = int(Path(self.path).read_text().strip() or "0")
        except (OSError, ValueError):
            return True
        if budget > 0:
            write_atomically(self.path, str(budget - 1))
            return True
        return False


class FailPrompt:
    """Fails every denoise forward that holds a request with exactly this prompt (its batch-mates are
    then retried alone and finish)."""

    def __init__(self, prompt: str):
        self.prompt = prompt

    def __call__(self, states: list) -> None:
        if any(s.params.get("prompt") == self.prompt for s in states):
            raise PipelineError(f"injected failure for the prompt {self.prompt!r}")


class NanPrompt:
    """Turns the latents of every request with exactly this prompt into NaN before its forward, as a
    diverging step would: the runner then fails that request alone (non-finite latents)."""

    def __init__(self, prompt: str):
        self.prompt = prompt

    def __call__(self, states: list) -> None:
        import torch  # noqa: PLC0415 (the stub has it loaded by now)

        from engine_lib.runner import _latents  # noqa: PLC0415

        with torch.inference_mode():
            for state in states:
                if state.params.get("prompt") == self.prompt:
                    for tensor in _latents(state):
                        tensor.fill_(float("nan"))


class SlowPrompt:
    """Sleeps `seconds` at every block boundary of a tick that holds a request with exactly this prompt: one
    long forward, as a huge request makes on real hardware, that a cancel can stop between two blocks."""

    def __init__(self, prompt: str, seconds: float):
        self.prompt, self.seconds = prompt, seconds
        self.blocks = 0  # boundaries slept at so far

    def __call__(self, requests: list) -> None:
        if any(r.params.get("prompt") == self.prompt for r in requests):
            self.blocks += 1
            time.sleep(self.seconds)


def _each(hooks: list[Callable[[list], None]]) -> Optional[Callable[[list], None]]:
    """One before_forward hook that calls each of `hooks` (None when there is none)."""
    if len(hooks) <= 1:
        return hooks[0] if hooks else None

    def call_each(states: list) -> None:
        for hook in hooks:
            hook(states)

    return call_each


def hooks_from_environment(model_name: str) -> Optional[EngineHooks]:
    """The hooks `DIFFUSION_TEST_HOOKS` names for this model, if any."""
    text = os.environ.get(ENVIRONMENT)
    if not text:
        return None
    spec = json.loads(text).get(model_name) or {}
    budget = spec.get("tick_budget_path")
    before_forward = _each([hook(spec[key]) for key, hook in (("fail_prompt", FailPrompt), ("nan_prompt", NanPrompt))
                            if spec.get(key)])
    slow = SlowPrompt(spec["slow_prompt"], float(spec.get("slow_block_s", 1.0))) if spec.get("slow_prompt") else None
    if not budget and before_forward is None and slow is None:
        return None
    return EngineHooks(tick_gate=FileTickBudget(budget) if budget else None, before_forward=before_forward,
                       before_block=slow)


def write_atomically(path: str, text: str) -> None:
    """Replace a small file in one step, so a reader never sees it half written."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    Path(tmp).write_text(text)
    os.replace(tmp, path)


def hooks_environment(**models: dict) -> dict[str, str]:
    """The environment entry that gives each named model its hooks, e.g.
    `hooks_environment(qwen_image={"tick_budget_path": path})`."""
    return {ENVIRONMENT: json.dumps(models)}
