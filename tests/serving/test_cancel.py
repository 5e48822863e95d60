"""A client cancel ends the request with CANCELLED, frees its engine state, and the next request succeeds.

The engine is held after the request's first step (the tick budget), so the request is certainly
still running when the cancel arrives, on any hardware.
"""

from __future__ import annotations

import re
import time

from tests.helpers.streaming import RequestStream, close_all, metric, run_request, scrape, wait_for_metric


def wait_for_log(server, pattern: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(pattern, server.log_text()):
            return True
        time.sleep(0.02)
    return False


def test_cancel_after_first_preview(server, held):
    cancelled_before = metric(scrape(server.metrics_url), "diffusion_requests_total", model="qwen_image",
                              outcome="cancelled")
    held.allow(1)  # one step, then the engine waits: the request is mid-denoise until the test says otherwise
    stream = RequestStream(server.grpc_url).send("to-cancel", prompt="long", height=64, width=64,
                                                 num_inference_steps=20, preview_interval=1)
    try:
        first = stream.wait_first(timeout=60)
        assert first.responses and not first.errors, first.errors
        assert first.responses[0].as_numpy("step")[0] == 1
        assert wait_for_metric(server.metrics_url, "diffusion_runner_states", 1.0, model="qwen_image") == 1.0
        stream.cancel()
        # The client sees its own CANCELLED at once; the server must notice and abort within 1 s.
        assert wait_for_log(server, r"qwen_image: cancelled request to-cancel#\d+", timeout=1.0), \
            server.log_tail(20)
        ended = stream.collect(timeout=5)
        assert ended.num_final == 1 and ended.error.status() == "StatusCode.CANCELLED"  # the client's own
        assert ended.steps() == [1]
    finally:
        close_all([stream])  # cancelled: it closes while the engine is still held

    # The engine holds nothing for it, though it is still held: no waiting or running request,
    # runner state or stream.
    for gauge in ("diffusion_requests_waiting", "diffusion_requests_running", "diffusion_runner_states",
                  "diffusion_open_streams"):
        assert wait_for_metric(server.metrics_url, gauge, 0.0, model="qwen_image") == 0.0, gauge
    assert wait_for_metric(server.metrics_url, "diffusion_requests_total", cancelled_before + 1,
                           model="qwen_image", outcome="cancelled") == cancelled_before + 1

    held.release()
    after = run_request(server.grpc_url, prompt="after cancel", height=32, width=32, num_inference_steps=2)
    assert not after.errors and after.num_final == 1
    assert after.final.as_numpy("image").shape == (1, 32, 32, 3)
