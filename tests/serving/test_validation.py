"""Every bad input gets one INVALID_ARG final error naming the input, while a valid request completes."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.streaming import RequestStream, post_json

VALID = dict(prompt="a valid prompt", height=32, width=32, num_inference_steps=2)

# (case name, inputs, the input the error must name). Values outside what the shipped
# config allows: max_height/max_width 1024, max_num_inference_steps 100, max_num_images 4, prompts of 4096 characters.
BAD_INPUTS = [
    ("empty prompt", dict(VALID, prompt=""), "prompt"),
    ("blank prompt", dict(VALID, prompt="   "), "prompt"),
    ("prompt not utf-8", dict(VALID, prompt=("BYTES", np.array([b"\xff\xfe"], dtype=np.object_))), "prompt"),
    ("prompt too long", dict(VALID, prompt="x" * 4097), "prompt"),
    ("negative prompt too long", dict(VALID, negative_prompt="x" * 4097), "negative_prompt"),
    ("height not a multiple", dict(VALID, height=33), "height"),
    ("height zero", dict(VALID, height=0), "height"),
    ("height negative", dict(VALID, height=-16), "height"),
    ("height over max", dict(VALID, height=1040), "height"),
    ("width over max", dict(VALID, width=2048), "width"),
    ("steps zero", dict(VALID, num_inference_steps=0), "num_inference_steps"),
    ("steps over max", dict(VALID, num_inference_steps=101), "num_inference_steps"),
    ("steps the pipeline cannot run", dict(VALID, num_inference_steps=1), "num_inference_steps"),
    ("guidance NaN", dict(VALID, guidance_scale=float("nan")), "guidance_scale"),
    ("guidance infinite", dict(VALID, guidance_scale=float("inf")), "guidance_scale"),
    ("true cfg negative", dict(VALID, true_cfg_scale=-1.0), "true_cfg_scale"),
    ("num_images zero", dict(VALID, num_images=0), "num_images"),
    ("num_images over max", dict(VALID, num_images=5), "num_images"),
    ("seed negative", dict(VALID, seed=-1), "seed"),
    ("preview interval negative", dict(VALID, preview_interval=-1), "preview_interval"),
    ("unknown output format", dict(VALID, output_format="jpeg"), "output_format"),
    ("priority negative", dict(VALID, priority=-1), "priority"),
    ("priority above the levels", dict(VALID, priority=4), "priority"),
    ("priority huge", dict(VALID, priority=2**31 - 1), "priority"),
    # Triton checks only how many inputs came, so this reaches the model (a request with none it refuses itself).
    ("missing prompt", {k: v for k, v in VALID.items() if k != "prompt"}, "prompt"),
    ("true cfg huge", dict(VALID, true_cfg_scale=1e38), "true_cfg_scale"),
    ("unknown cache", dict(VALID, cache="fast"), "cache"),
    ("cache misspelled", dict(VALID, cache="taylor_seer"), "cache"),
    ("cache upper case", dict(VALID, cache="FIRST_BLOCK"), "cache"),  # choices are taken only as written
    ("cache with a space", dict(VALID, cache=" first_block"), "cache"),
    ("output format with a newline", dict(VALID, output_format="png\n"), "output_format"),
    ("cache threshold negative", dict(VALID, cache="first_block", cache_threshold=-1.0), "cache_threshold"),
    ("cache threshold NaN", dict(VALID, cache_threshold=float("nan")), "cache_threshold"),
    ("cache threshold without the cache", dict(VALID, cache_threshold=0.3), "cache_threshold"),  # changes nothing
    ("cache threshold with taylorseer", dict(VALID, cache="taylorseer", cache_threshold=0.3), "cache_threshold"),
]

# Rejected by Triton itself (config.pbtxt types and shapes) before the model sees them:
# still INVALID_ARG-class errors that name the input, but Triton words them.
TRITON_REJECTED = [
    ("height as FP32", dict(VALID, height=("FP32", np.array([32.0], dtype=np.float32))), "height"),
    ("height of shape [2]", dict(VALID, height=("INT32", np.array([32, 32], dtype=np.int32))), "height"),
    ("priority as FP32", dict(VALID, priority=("FP32", np.array([1.0], dtype=np.float32))), "priority"),
]


def test_bad_inputs_are_rejected_while_a_valid_request_completes(server):
    valid = RequestStream(server.grpc_url).send("valid", **dict(VALID, num_inference_steps=20, preview_interval=5))
    bad = [(name, RequestStream(server.grpc_url).send(f"bad-{i}", **inputs), input_name)
           for i, (name, inputs, input_name) in enumerate(BAD_INPUTS + TRITON_REJECTED)]
    problems = []
    try:
        for i, (name, stream, input_name) in enumerate(bad):
            result = stream.collect(timeout=60)
            if result.responses or len(result.errors) != 1:
                problems.append(f"{name}: {len(result.responses)} responses, {len(result.errors)} errors")
                continue
            message = result.error.message()
            if f"'{input_name}'" not in message:
                problems.append(f"{name}: error does not name '{input_name}': {message}")
            if i < len(BAD_INPUTS) and not message.startswith(f"INVALID_ARG: [request id: bad-{i}] "):
                problems.append(f"{name}: not an INVALID_ARG error for bad-{i}: {message}")
        done = valid.collect(timeout=120)
    finally:
        for _, stream, _ in bad:
            stream.close()
        valid.close()
    assert not problems, "\n".join(problems)
    assert not done.errors and done.num_final == 1
    assert done.final.as_numpy("image").shape == (1, 32, 32, 3)


@pytest.mark.parametrize("cache", [dict(cache="first_block", cache_threshold=0.5), dict(cache="taylorseer")],
                         ids=["first_block", "taylorseer"])
def test_the_cache_inputs_reach_the_engine(server, cache):
    """A served request with a step cache is the image the engine makes for it in-process, which the cache
    changed (it reused or predicted steps)."""
    from engine_lib.pipelines.qwen_image.adapter import QwenImageAdapter
    from tests.helpers.parity_checks import load_tiny_adapter, solo_steps

    inputs = dict(prompt="a cat", height=64, width=64, num_inference_steps=6, seed=3)
    cached = dict(inputs, **cache)
    stream = RequestStream(server.grpc_url).send("cached", **cached)
    try:
        result = stream.collect(timeout=120)
    finally:
        stream.close()
    assert not result.errors and result.num_final == 1
    adapter = load_tiny_adapter("qwen_image", QwenImageAdapter)
    expected = solo_steps(adapter, cached)
    assert not np.array_equal(expected, solo_steps(adapter, inputs))
    served = result.final.as_numpy("image").astype(int)
    assert np.abs(served - expected.astype(int)).max() <= 1


@pytest.mark.parametrize("body, input_name", [
    ({"prompt": "ok", "height": 33}, "height"),
    ({"prompt": "ok", "output_format": "gif"}, "output_format"),
    ({"height": 32}, "prompt"),
    ({"prompt": "ok", "heigth": 64}, "heigth"),  # a misspelled key reaches the model as a request parameter
    ({"prompt": "ok", "priority": 9}, "priority"),
    ({"prompt": "ok", "parameters": {"strength": 0.5}}, "strength"),
    ({"prompt": "ok", "parameters": {"nested": {"deep": [1, [2, {"x": 3}]]}}}, "nested"),
])
def test_http_bad_input_is_400_naming_the_input(server, body, input_name):
    status, reply = post_json(f"http://{server.http_url}/v2/models/qwen_image/generate_stream", body)
    assert status == 400, reply
    assert f"'{input_name}'" in reply.decode()
