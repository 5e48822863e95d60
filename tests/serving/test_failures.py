"""A pipeline failure through Triton: the failing request ends with INTERNAL, its batch-mates finish
with their images, the failure is counted (`error`), and so is the batch's retry one request at a time
(`diffusion_batch_retries_total`), and logged through Triton's log (engine_lib's logging is forwarded by
the model).

The shared server's injected failure (engine_lib/hooks.py) makes it: a batch holding its prompt fails its
denoise forward, so the runner retries each request alone, as with a real pipeline error. The
engine is held until all four have joined one step batch.
"""

from __future__ import annotations

from tests.helpers.servers import FAIL_PROMPT, NAN_PROMPT
from tests.helpers.streaming import RequestStream, close_all, metric, run_held, scrape, wait_for_metric

LABELS = dict(model="qwen_image")


def test_internal_error_ends_only_its_request(server, held):
    before = scrape(server.metrics_url)
    errors_before = metric(before, "diffusion_requests_total", outcome="error", **LABELS)
    retries = metric(before, "diffusion_batch_retries_total", **LABELS) + 1  # the batch of four, once
    held.hold()
    prompts = ["a red cube", FAIL_PROMPT, "a blue cube", "a green cube"]
    streams = [RequestStream(server.grpc_url).send(f"f{i}", prompt=p, height=32, width=32, num_inference_steps=3,
                                                   seed=i)
               for i, p in enumerate(prompts)]
    try:
        run_held(server, waiting=4, ticks=100)  # all four join the first step batch
        results = [stream.collect(timeout=120) for stream in streams]
    finally:
        close_all(streams, held)
    failed = results[1]
    assert failed.num_final == 1 and not failed.responses and len(failed.errors) == 1
    message = failed.error.message()
    assert message.startswith("INTERNAL: [request id: f1] ") and "injected failure" in message, message
    for result in results[:1] + results[2:]:
        assert not result.errors and result.num_final == 1
        assert result.final.as_numpy("image").shape == (1, 32, 32, 3)
    assert wait_for_metric(server.metrics_url, "diffusion_requests_total", errors_before + 1, outcome="error",
                           **LABELS) == errors_before + 1
    assert wait_for_metric(server.metrics_url, "diffusion_batch_retries_total", retries, **LABELS) == retries
    log = server.log_text()
    assert "engine_lib.runner: batched denoise of 4 requests failed" in log  # a warning, forwarded
    assert "engine_lib.runner: request f1#" in log and "injected failure" in log


def test_a_request_whose_latents_turn_nan_fails_alone(server, held):
    """A step that leaves one request's latents non-finite (the shared server's NAN_PROMPT hook, as a diverging
    step would) ends that request with INTERNAL naming the step; the request sharing its forwards finishes."""
    errors_before = metric(scrape(server.metrics_url), "diffusion_requests_total", outcome="error", **LABELS)
    held.hold()
    streams = [RequestStream(server.grpc_url).send(f"n{i}", prompt=p, height=32, width=32, num_inference_steps=3,
                                                   seed=i)
               for i, p in enumerate(["a red cube", NAN_PROMPT])]
    try:
        run_held(server, waiting=2, ticks=100)  # both join the first step batch
        good, bad = (stream.collect(timeout=120) for stream in streams)
    finally:
        close_all(streams, held)
    assert bad.num_final == 1 and not bad.responses and len(bad.errors) == 1
    assert bad.error.message() == "INTERNAL: [request id: n1] non-finite latents after step 1 of 3", bad.error.message()
    assert not good.errors and good.num_final == 1
    image = good.final.as_numpy("image")
    assert image.shape == (1, 32, 32, 3) and image.std() > 0  # an image, not the black of NaN cast to uint8
    assert wait_for_metric(server.metrics_url, "diffusion_requests_total", errors_before + 1, outcome="error",
                           **LABELS) == errors_before + 1
