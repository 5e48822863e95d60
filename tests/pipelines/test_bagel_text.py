"""BAGEL's text decoding (text answers, think mode) against golden data from the reference implementation.

tests/golden/bagel/think.npz comes from ByteDance-Seed/Bagel's `interleave_inference` run greedily in float32 on the
tiny checkpoint (`reference_think.py`, README): the prefilled ids (templates, system prompts), the decoded ids and
text of an answer that ends on `<|im_end|>`, one that stops at its cap, an answer after thinking, and an image after
thinking, with image CFG off and on. The reference's cap counts `<|im_start|>` too, so ours (`max_new_tokens`) is one
less.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_lib.pipelines.bagel.adapter import BagelAdapter
from engine_lib.pipelines.bagel.pipeline import GEN_THINK_SYSTEM_PROMPT, VLM_THINK_SYSTEM_PROMPT
from engine_lib.pipelines.base import move_tensors
from engine_lib.request import InvalidInputError
from tests.helpers.parity_checks import Arrival, load_tiny_adapter, parse, run_arrivals, step_engine, text_chunks

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "bagel" / "think.npz"
SYSTEM = {"answer_ends": "", "answer_capped": "", "think_answer": VLM_THINK_SYSTEM_PROMPT,
          "think_image": GEN_THINK_SYSTEM_PROMPT}


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(GOLDEN))


@pytest.fixture(scope="module")
def adapter():
    return load_tiny_adapter("bagel", BagelAdapter)


@pytest.fixture(scope="module")
def pipe(adapter):
    return adapter.pipe


def max_new_tokens(golden, case: str) -> int:
    return int(golden[f"{case}_max_new_tokens"]) - 1


def prefills(golden, case: str) -> list[list[int]]:
    """The reference's prefilled texts in call order."""
    out, current = [], []
    for i in golden[f"{case}_prefills"].tolist():
        if i < 0:
            out.append(current)
            current = []
        else:
            current.append(i)
    return out


def test_the_system_prompts_are_the_references(golden):
    assert VLM_THINK_SYSTEM_PROMPT == str(golden["vlm_think_system_prompt"])
    assert GEN_THINK_SYSTEM_PROMPT == str(golden["gen_think_system_prompt"])


@pytest.mark.parametrize("case", SYSTEM)
def test_greedy_ids_and_text_are_the_references(pipe, golden, case):
    prompt, system = str(golden[f"{case}_prompt"]), SYSTEM[case]
    expected = [pipe.token_ids(prompt)] * 2  # the generation and image-CFG contexts
    if system:
        expected = [pipe.token_ids(system)] * 2 + expected
    assert prefills(golden, case)[:len(expected)] == expected
    context = pipe.encode(prompt, 0, 0, system)
    decode = pipe.generate_text(context.cond, max_new_tokens(golden, case))
    assert decode.ids == golden[f"{case}_generated_ids"].tolist()
    assert pipe.text(decode.ids) == str(golden[f"{case}_text"])


def test_one_answer_ends_on_its_end_token_and_one_at_its_cap(pipe, golden):
    ends = pipe.generate_text(pipe.encode(str(golden["answer_ends_prompt"]), 0, 0).cond, 100)
    assert ends.new_tokens == len(golden["answer_ends_generated_ids"]) - 1 < max_new_tokens(golden, "answer_ends")
    capped = pipe.generate_text(pipe.encode(str(golden["answer_capped_prompt"]), 0, 0).cond, 5)
    assert capped.new_tokens == 5 and capped.ids == golden["answer_capped_generated_ids"].tolist()[:6]


def test_the_image_after_thinking_is_the_references(pipe, golden):
    """The thought, re-encoded, in the image's context: the image within one uint8 level of the reference's."""
    out = pipe(str(golden["think_image_prompt"]), 64, 64, num_inference_steps=5,
               generator=torch.Generator().manual_seed(1), guidance_scale=4.0, think=True,
               max_new_tokens=max_new_tokens(golden, "think_image"))
    assert out.text == str(golden["think_image_text"])
    assert prefills(golden, "think_image")[-1] == pipe.token_ids(out.text)
    image = (out.images[0] * 255).round().astype(int)
    assert np.abs(image - golden["think_image_image_u8"].astype(int)).max() <= 1


def image_cfg_think(pipe, golden, **changes):
    """The golden image-CFG think request through `BagelPipeline.__call__`: its output and each step's input
    latents."""
    seen, predict = [], pipe.predict

    def recorded(rows, latents, *args, **kwargs):
        seen.append(latents[0].clone())
        return predict(rows, latents, *args, **kwargs)
    pipe.predict = recorded
    try:
        out = pipe(str(golden["think_image_cfg_img_prompt"]), 64, 64, num_inference_steps=5,
                   generator=torch.Generator().manual_seed(1), guidance_scale=4.0, cfg_img_scale=2.0, think=True,
                   max_new_tokens=max_new_tokens(golden, "think_image_cfg_img"), **changes)
    finally:
        del pipe.predict
    return out, torch.stack(seen).numpy()


def test_think_with_image_cfg_guides_against_the_prompt_without_the_thought(pipe, golden):
    """The reference prefills the thought into the generation context only: its image-CFG context keeps the system
    prompt and the prompt (5 prefills: those two into both contexts, then the thought). Each step's latents are
    the reference's within float32 rounding (guiding against a context with the thought is 5e-3 off), the image
    within one level."""
    prompt = str(golden["think_image_cfg_img_prompt"])
    out, latents = image_cfg_think(pipe, golden)
    assert out.text == str(golden["think_image_cfg_img_text"])
    assert prefills(golden, "think_image_cfg_img") == [pipe.token_ids(GEN_THINK_SYSTEM_PROMPT)] * 2 + [
        pipe.token_ids(prompt)] * 2 + [pipe.token_ids(out.text)]
    np.testing.assert_allclose(latents, golden["think_image_cfg_img_latents_in"], rtol=0, atol=1e-5)
    image = (out.images[0] * 255).round().astype(int)
    assert np.abs(image - golden["think_image_cfg_img_image_u8"].astype(int)).max() <= 1
    assert np.abs(image - golden["think_image_image_u8"].astype(int)).max() > 1  # the scale matters


def test_sampled_text_is_reproducible_per_seed(pipe):
    context = pipe.encode("a red cube on a blue floor", 0, 0)
    runs = [pipe.generate_text(context.cond, 12, temperature=1.0, seed=seed).ids for seed in (5, 5, 6)]
    greedy = pipe.generate_text(context.cond, 12).ids
    assert runs[0] == runs[1] and runs[0] != runs[2] and runs[0] != greedy


# -- through the runner: the served inputs, text decoded one token per tick ---------------------------------------


def golden_request(adapter, golden, case: str, **changes):
    inputs = {"prompt": str(golden[f"{case}_prompt"]), "max_new_tokens": max_new_tokens(golden, case),
              "think": case.startswith("think"),
              "output_modality": "image" if case.startswith("think_image") else "text",
              "height": 64, "width": 64, "num_inference_steps": 5, "guidance_scale": 4.0, "seed": 1}
    return parse(adapter, {**inputs, **changes})


def run_ticks(adapter, requests: dict) -> tuple[dict, dict]:
    """Requests (id -> params) admitted together, stepped through an engine: final outputs, and each one's
    streamed `text` chunks."""
    result = run_arrivals(step_engine(adapter, capacity=len(requests), float_output=True),
                          [Arrival(0, rid, p) for rid, p in requests.items()])
    return result.outputs, {rid: text_chunks(result).get(rid, []) for rid in requests}


@pytest.fixture
def text_forwards(adapter, monkeypatch) -> list[int]:
    """The rows of each one-token text forward, in order."""
    model, seen = adapter.pipe.model, []
    extend = model.extend
    monkeypatch.setattr(model, "extend", lambda caches, ids: (seen.append(len(caches)) if ids.shape[1] == 1 else None)
                        or extend(caches, ids))
    return seen


def test_the_served_inputs(adapter):
    p = parse(adapter, {"prompt": "a cat"})
    assert (p.think, p.output_modality, p.max_new_tokens, p.temperature) == (False, "image", 999, 0.0)
    assert adapter.total_steps(p) == p.num_inference_steps
    p = parse(adapter, {"prompt": "a cat", "think": True, "max_new_tokens": 7, "num_inference_steps": 4})
    assert adapter.total_steps(p) == 11
    assert adapter.total_steps(parse(adapter, {"prompt": "a", "output_modality": "text", "max_new_tokens": 7})) == 7
    for name, value in (("think", 1), ("output_modality", "video"), ("output_modality", "TEXT"),
                        ("output_modality", "text\n"), ("max_new_tokens", 0), ("max_new_tokens", 4097),
                        ("temperature", -0.1), ("temperature", 11.0)):
        with pytest.raises(InvalidInputError, match=name):
            parse(adapter, {"prompt": "a cat", name: value})
    image_cfg = {"prompt": "a cat", "cfg_img_scale": 1.5, "height": 64, "width": 64}
    plain, think = parse(adapter, image_cfg), parse(adapter, {**image_cfg, "think": True})
    assert adapter.request_cost(think) == 3 * adapter.request_cost(plain) // 2  # an image-CFG row of its own


def test_requests_decoding_together_give_the_references_answers_thought_and_image(adapter, golden, text_forwards):
    """The four golden cases admitted together: their text phases share one forward per tick (rows against caches
    of different lengths), the think image's denoise steps share ticks with the others' decoding, and every id,
    text and the image are the reference's. The streamed characters add up to each final text."""
    requests = {case: golden_request(adapter, golden, case) for case in SYSTEM}
    outputs, chunks = run_ticks(adapter, requests)
    for case in SYSTEM:
        text = outputs[case]["text"][0]
        assert text == str(golden[f"{case}_text"]), case
        assert "".join(chunks[case]) == text and len(chunks[case]) > 1, case
        assert outputs[case]["finish_reason"][0] == ("stop" if case == "answer_ends" else "length"), case
    assert "image" not in outputs["answer_ends"]
    image = (outputs["think_image"]["image"][0] * 255).round().astype(int)
    assert np.abs(image - golden["think_image_image_u8"].astype(int)).max() <= 1
    # One forward per tick while any decodes: capped ones take their cap (9, 11, 15), the one that ends takes a
    # forward per id it keeps (30 with <|im_start|>), its last one predicting <|im_end|>.
    assert text_forwards == [4] * 9 + [3] * 2 + [2] * 4 + [1] * 15


def test_max_text_rows_decodes_one_request_per_tick_and_the_others_wait(adapter, golden, monkeypatch, text_forwards):
    """The `think` benchmark's baseline: with max_text_rows=1 the four golden cases' text phases run one row per
    forward (the 9 + 11 + 15 + 30 rows the shared run puts into 30 forwards), while the think image's denoise
    steps go on beside them; every text and the image are still the reference's."""
    monkeypatch.setattr(adapter, "max_text_rows", 1)
    outputs, _ = run_ticks(adapter, {case: golden_request(adapter, golden, case) for case in SYSTEM})
    for case in SYSTEM:
        assert outputs[case]["text"][0] == str(golden[f"{case}_text"]), case
    image = (outputs["think_image"]["image"][0] * 255).round().astype(int)
    assert np.abs(image - golden["think_image_image_u8"].astype(int)).max() <= 1
    assert text_forwards == [1] * (9 + 11 + 15 + 30)


def test_a_plain_image_beside_decoding_requests_equals_its_solo_run(adapter, golden):
    plain = golden_request(adapter, golden, "think_image", think=False, seed=3)
    together, _ = run_ticks(adapter, {"plain": plain, "answer": golden_request(adapter, golden, "answer_capped"),
                                      "think": golden_request(adapter, golden, "think_image")})
    solo, _ = run_ticks(adapter, {"plain": plain})
    np.testing.assert_array_equal(together["plain"]["image"], solo["plain"]["image"])
    assert "text" not in solo["plain"]


def test_think_with_image_cfg_through_the_runner_beside_others_equals_the_pipeline(adapter, golden):
    """Served, the image-CFG request's rows (three while CFG runs) share forwards with a plain image and an answer
    decoding: its image is `__call__`'s bit for bit."""
    think = golden_request(adapter, golden, "think_image_cfg_img", cfg_img_scale=2.0)
    outputs, _ = run_ticks(adapter, {"think": think, "answer": golden_request(adapter, golden, "answer_capped"),
                                     "plain": golden_request(adapter, golden, "think_image", think=False, seed=3)})
    alone, _ = image_cfg_think(adapter.pipe, golden)
    assert outputs["think"]["text"][0] == alone.text
    np.testing.assert_array_equal(outputs["think"]["image"][0], alone.images[0])


def test_sampled_answers_through_the_runner_repeat_per_seed(adapter, golden):
    runs = [run_ticks(adapter, {"r": golden_request(adapter, golden, "answer_capped", temperature=1.0, seed=seed)})[0]
            for seed in (4, 4, 8)]
    texts = [r["r"]["text"][0] for r in runs]
    assert texts[0] == texts[1] != texts[2]


def test_think_travels_as_a_bool_tensor(adapter):
    from engine_lib.serving.openai_api.gateway import InputType, to_tensor
    from engine_lib.serving.tensors import read_inputs

    specs = {s.name: s for s in adapter.input_specs()}
    assert read_inputs({"think": np.array([True])}, specs) == {"think": True}
    assert to_tensor("think", True, InputType("TYPE_BOOL")).dtype == np.bool_
    with pytest.raises(InvalidInputError, match="think"):
        read_inputs({"think": np.array([1], dtype=np.int32)}, specs)
    with pytest.raises(InvalidInputError, match="think"):
        to_tensor("think", 1, InputType("TYPE_BOOL"))


def test_a_decoding_request_paused_for_an_urgent_one_ends_as_alone(adapter, golden):
    """One seat: an answer decoding is preempted at tick 2 by an urgent think request (whose thought ends early
    into its denoise steps), then resumes; both give the reference's texts. Its growing cache is step state: a
    pause on a GPU moves it with the rest."""
    engine = step_engine(adapter, capacity=1, float_output=True, max_preemptions=1)
    answer, think = golden_request(adapter, golden, "answer_ends"), golden_request(adapter, golden, "think_image")

    def paused_state_moves(tick):
        if tick == 1:  # (a copy: a meta tensor cannot come back)
            moved = move_tensors(copy.deepcopy(engine.runner.states["slow"]), torch.device("meta"))
            assert moved.text.cache.keys[0].device.type == "meta"

    result = run_arrivals(engine, [Arrival(0, "slow", answer, priority=2), Arrival(2, "urgent", think, priority=1)],
                          on_tick=paused_state_moves)
    assert result.paused == ["slow"]
    assert result.outputs["slow"]["text"][0] == str(golden["answer_ends_text"])
    assert result.outputs["urgent"]["text"][0] == str(golden["think_image_text"])
