"""What a client may send, through a real tritonserver: inputs only as typed tensors (request parameters never
stand in for them), float knobs only in their finite ranges, and a priority above the model's default only with
the server's priority key. The shared `server` (tests/helpers/servers.py: SERVER_PRIORITY_KEY) and the `secured` launcher
(launched.PRIORITY_KEY) serve qwen_image: default_priority_level 2 of 3."""

from __future__ import annotations

import json

import pytest

from tests.helpers.servers import SERVER_PRIORITY_KEY, URGENT
from tests.helpers.streaming import RequestStream, make_inputs, post_json, run_request

SMALL = dict(height=32, width=32, num_inference_steps=2)


def assert_refused(result, request_id: str, input_name: str, *fragments: str) -> str:
    assert not result.responses and len(result.errors) == 1, (result.responses, result.errors)
    message = result.error.message()
    assert message.startswith(f"INVALID_ARG: [request id: {request_id}] input '{input_name}': "), message
    assert all(fragment in message for fragment in fragments), message
    return message


def assert_served(result) -> None:
    assert not result.errors and result.num_final == 1, result.errors
    assert result.final.as_numpy("image").shape == (1, 32, 32, 3)


# -- request parameters are never inputs ---------------------------------------------------------------------


def test_a_declared_input_sent_as_a_request_parameter_is_refused_naming_it(server):
    result = run_request(server.grpc_url, request_id="param-height", prompt="x", parameters={"height": 32}, **{
        k: v for k, v in SMALL.items() if k != "height"})
    assert_refused(result, "param-height", "height", "must be sent as a tensor, not a request parameter")


def test_a_prompt_sent_only_as_a_request_parameter_is_not_served(server):
    """It was served as if sent as a tensor (the parameters were merged into the inputs)."""
    result = run_request(server.grpc_url, request_id="param-prompt", parameters={"prompt": "a cat"}, **SMALL)
    assert_refused(result, "param-prompt", "prompt", "must be sent as a tensor, not a request parameter")


def test_an_unknown_request_parameter_is_refused_naming_it_and_the_nearest_input(server):
    result = run_request(server.grpc_url, request_id="param-typo", prompt="x", parameters={"heigth": 32}, **SMALL)
    assert_refused(result, "param-typo", "heigth", "does not use this input", "did you mean 'height'")


def test_what_triton_adds_to_a_request_is_not_refused(server):
    """tritonclient's priority=, timeout=, request id and empty final response, and HTTP generate's "id", are
    Triton's own: none of them reaches the model as a parameter it would refuse."""
    stream = RequestStream(server.grpc_url)
    try:
        stream.client.async_stream_infer("qwen_image", make_inputs(prompt="triton's own", **SMALL), request_id="own",
                                         enable_empty_final_response=True, priority=1, timeout=60_000_000)
        assert_served(stream.collect(timeout=60))
    finally:
        stream.close()
    status, reply = post_json(f"http://{server.http_url}/v2/models/qwen_image/generate",
                              {"id": "http-id", "prompt": "x", **SMALL})
    assert status == 200 and json.loads(reply)["id"] == "http-id", reply


# -- floats: finite, and within their declared ranges --------------------------------------------------------


@pytest.mark.parametrize("value, fragment", [(1e38, "in [0, 100]"), (float("nan"), "finite"),
                                             (float("-inf"), "finite")])
def test_a_huge_or_non_finite_scale_is_refused_naming_it(server, value, fragment):
    result = run_request(server.grpc_url, request_id="scale", prompt="x", negative_prompt="y",
                         true_cfg_scale=value, **SMALL)
    assert_refused(result, "scale", "true_cfg_scale", fragment)


def test_a_huge_scale_over_http_is_400_naming_it(server):
    status, reply = post_json(f"http://{server.http_url}/v2/models/qwen_image/generate",
                              {"prompt": "x", "true_cfg_scale": 1e38, **SMALL})
    assert status == 400 and "input 'true_cfg_scale'" in reply.decode() and "[0, 100]" in reply.decode(), reply


# -- who may jump the queue ----------------------------------------------------------------------------------


def test_priority_above_the_default_needs_the_priority_key(server):
    refused = run_request(server.grpc_url, request_id="no-key", prompt="x", priority=1, **SMALL)
    assert_refused(refused, "no-key", "priority", "priority_key", "send 0 or a level in [2, 3]")
    wrong = run_request(server.grpc_url, request_id="wrong-key", prompt="x", priority=1,
                        parameters={"priority_key": SERVER_PRIORITY_KEY + "x"}, **SMALL)
    assert_refused(wrong, "wrong-key", "priority")
    assert_served(run_request(server.grpc_url, prompt="x", priority=1, parameters=URGENT, **SMALL))
    for level in (0, 2, 3):  # the default and below stay open to every client
        assert_served(run_request(server.grpc_url, prompt="x", priority=level, **SMALL))


def test_priority_key_over_http_generate_is_a_json_key(server):
    url = f"http://{server.http_url}/v2/models/qwen_image/generate"
    status, reply = post_json(url, {"prompt": "x", "priority": 1, **SMALL})
    assert status == 400 and "input 'priority'" in reply.decode() and "priority_key" in reply.decode(), reply
    status, reply = post_json(url, {"prompt": "x", "priority": 1, "priority_key": SERVER_PRIORITY_KEY, **SMALL})
    assert status == 200 and json.loads(reply)["is_final"] is True, reply


def test_the_launchers_priority_key_opens_priority_one(secured):
    from tests.helpers.launched import PRIORITY_KEY  # noqa: PLC0415

    refused = run_request(secured.grpc_url, request_id="secured-no-key", prompt="x", priority=1, **SMALL)
    assert_refused(refused, "secured-no-key", "priority", "priority_key")
    assert_served(run_request(secured.grpc_url, prompt="x", priority=1, parameters={"priority_key": PRIORITY_KEY},
                              **SMALL))
