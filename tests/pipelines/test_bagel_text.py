"""BAGEL's text decoding (text answers, think mode) against golden data from the reference implementation.

tests/golden/bagel/think.npz comes from ByteDance-Seed/Bagel's `interleave_inference` run greedily in float32 on the
tiny checkpoint (`reference_think.py`, README): the prefilled ids (templates, system prompts), the decoded ids and
text of an answer that ends on `<|im_end|>`, one that stops at its cap, an answer after thinking, and an image after
thinking. The reference's cap counts `<|im_start|>` too, so ours (`max_new_tokens`) is one less.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine_lib.pipelines.bagel.adapter import BagelAdapter
from engine_lib.pipelines.bagel.pipeline import GEN_THINK_SYSTEM_PROMPT, VLM_THINK_SYSTEM_PROMPT
from parity_checks import load_tiny_adapter

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "bagel" / "think.npz"
SYSTEM = {"answer_ends": "", "answer_capped": "", "think_answer": VLM_THINK_SYSTEM_PROMPT,
          "think_image": GEN_THINK_SYSTEM_PROMPT}


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(GOLDEN))


@pytest.fixture(scope="module")
def pipe():
    return load_tiny_adapter("bagel", BagelAdapter).pipe


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


def test_sampled_text_is_reproducible_per_seed(pipe):
    context = pipe.encode("a red cube on a blue floor", 0, 0)
    runs = [pipe.generate_text(context.cond, 12, temperature=1.0, seed=seed).ids for seed in (5, 5, 6)]
    greedy = pipe.generate_text(context.cond, 12).ids
    assert runs[0] == runs[1] and runs[0] != runs[2] and runs[0] != greedy
