"""HunyuanImage-3.0's think / recaption (a text before the image) against golden data from the reference.

tests/golden/hunyuan_image3/think.npz comes from Tencent-Hunyuan/HunyuanImage-3.0's `generate_image(...,
bot_task=...)` run greedily in float32 on the tiny checkpoint (`reference_think.py`, README): per case the text
phase's context ids, the decoded ids (end token kept), the thought (`get_cot_text`), the image's cond / uncond
ids and the image. One text ends on `</answer>`, one on `</recaption>` (its markers stay in the unconditional
row), one at its cap.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest

from engine_lib.pipelines.hunyuan_image3 import think
from engine_lib.pipelines.hunyuan_image3.adapter import HunyuanImage3Adapter
from engine_lib.request import DiffusionRequest, InvalidInputError
from engine_lib.runner import ModelRunner
from tests.helpers.parity_checks import Arrival, load_tiny_adapter, parse, run_arrivals, step_engine, text_chunks

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "hunyuan_image3" / "think.npz"
# case -> the reference's generate_image arguments (reference_think.py's CASES)
CASES = {
    "think_ends": dict(bot_task="think", prompt="draw cat big the", max_new_tokens=60, height=64, width=64,
                       guidance_scale=5.0, seed=1),
    "recaption_ends": dict(bot_task="recaption", prompt="cat cube old", max_new_tokens=20, height=48, width=80,
                           guidance_scale=3.5, seed=2),
    "think_capped": dict(bot_task="think", prompt="the red house !", max_new_tokens=12, height=64, width=64,
                         guidance_scale=5.0, seed=3),
}


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(GOLDEN))


@pytest.fixture(scope="module")
def adapter():
    return load_tiny_adapter("hunyuan_image3", HunyuanImage3Adapter)


def request(adapter, case: str, **changes):
    return parse(adapter, {**CASES[case], "num_inference_steps": 4, **changes})


@pytest.mark.parametrize("case", CASES)
def test_the_text_and_the_image_context_are_the_references(adapter, golden, case):
    """Greedy ids equal, end token included; the thought re-encoded into both image rows as the reference does."""
    thinker, c = adapter.thinker, CASES[case]
    context = thinker.text_ids(c["prompt"], c["bot_task"])
    assert context == golden[f"{case}_text_input_ids"].tolist()
    decode = thinker.generate(context, c["max_new_tokens"])
    assert decode.ids[1:] == golden[f"{case}_new_ids"].tolist()
    thought = thinker.thought(context, decode)
    assert thought == str(golden[f"{case}_cot_text"])
    for row, uncond in enumerate((False, True)):
        ids = thinker.image_ids(c["prompt"], thought, c["height"], c["width"], uncond)
        assert ids == golden[f"{case}_image_input_ids"][row, :len(ids)].tolist()


def test_sampled_text_is_reproducible_per_seed(adapter):
    thinker = adapter.thinker
    context = thinker.text_ids("the red house !", "think")
    runs = [thinker.generate(context, 8, temperature=1.0, seed=seed).ids for seed in (5, 5, 6)]
    assert runs[0] == runs[1] != runs[2] and runs[0] != thinker.generate(context, 8).ids


def test_the_served_inputs(adapter):
    p = parse(adapter, {"prompt": "a cat"})
    assert (p.bot_task, p.max_new_tokens, p.temperature) == ("image", 1024, 0.0)
    assert adapter.total_steps(p) == p.num_inference_steps
    assert adapter.total_steps(parse(adapter, {"prompt": "a", "bot_task": "recaption", "max_new_tokens": 7,
                                               "num_inference_steps": 4})) == 11
    for name, value in (("bot_task", "auto"), ("bot_task", "RECAPTION"), ("bot_task", "think\n"),
                        ("max_new_tokens", 0), ("temperature", -1.0)):
        with pytest.raises(InvalidInputError, match=name):
            parse(adapter, {"prompt": "a cat", name: value})


def test_a_folder_without_the_text_head_refuses_think_naming_bot_task(adapter, monkeypatch):
    monkeypatch.setattr(adapter.pipe, "text_head", None)
    headless = type(adapter)(adapter.pipe, adapter.device, adapter.dtype, adapter.config)
    headless.check_inputs(parse(headless, {"prompt": "a cat"}))
    with pytest.raises(InvalidInputError, match="bot_task"):
        headless.check_inputs(parse(headless, {"prompt": "a cat", "bot_task": "think"}))


def test_requests_joining_at_different_ticks_give_the_references_texts_and_images(adapter, golden, monkeypatch):
    """The three cases join at ticks 0, 2 and 5 through the runner: the text phases share one forward per tick
    (rows against caches of different lengths) beside the others' denoise steps; every text, finish_reason and
    image is the reference's (its solo run), and the streamed characters add up to each text."""
    text_rows, extend = [], think.extend
    monkeypatch.setattr(think, "extend", lambda model, caches, ids: text_rows.append(len(caches)) or
                        extend(model, caches, ids))
    arrivals = [Arrival(tick, case, request(adapter, case))
                 for tick, case in ((0, "think_ends"), (2, "recaption_ends"), (5, "think_capped"))]
    result = run_arrivals(step_engine(adapter, capacity=len(arrivals), float_output=True), arrivals)
    outputs, chunks = result.outputs, text_chunks(result)
    for case in CASES:
        text = outputs[case]["text"][0]
        assert text == str(golden[f"{case}_cot_text"]), case
        assert "".join(chunks[case]) == text and len(chunks[case]) > 1, case
        assert outputs[case]["finish_reason"][0] == ("length" if case == "think_capped" else "stop"), case
        image = (outputs[case]["image"][0] * 255).round().astype(int)
        assert np.abs(image - golden[f"{case}_image_u8"].astype(int)).max() <= 1, case
    # think_ends decodes at ticks 0-37, recaption_ends at 2-4, think_capped at 5-16: one forward per tick.
    assert text_rows == [1] * 2 + [2] * 3 + [2] * 12 + [1] * 21


def test_a_text_phase_preempted_resumes_and_a_cancelled_one_frees_its_cache(adapter, golden):
    """One seat: a capped think request decoding is preempted at tick 2 by an urgent recaption one and resumes;
    both give the reference's texts. A request cancelled while decoding leaves nothing holding its cache."""
    slow_p, urgent_p = request(adapter, "think_capped"), request(adapter, "recaption_ends")
    result = run_arrivals(step_engine(adapter, capacity=1, float_output=True, max_preemptions=1),
                          [Arrival(0, "slow", slow_p, priority=2), Arrival(2, "urgent", urgent_p, priority=1)])
    assert result.paused == ["slow"]
    assert result.outputs["slow"]["text"][0] == str(golden["think_capped_cot_text"])
    assert result.outputs["urgent"]["text"][0] == str(golden["recaption_ends_cot_text"])

    runner = ModelRunner(adapter, float_outputs=True)
    cancelled = DiffusionRequest("cancelled", slow_p, num_steps=adapter.total_steps(slow_p))
    runner.execute_step([cancelled], [])
    runner.execute_step([], [cancelled])
    text = runner.states["cancelled"].text
    assert text.new_tokens == 2 and not text.done
    key = weakref.ref(text.cache.keys[0])
    del text
    runner.free(["cancelled"])
    gc.collect()
    assert "cancelled" not in runner.states and key() is None
