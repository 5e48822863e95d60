"""Over max_queue a request is refused with UNAVAILABLE; admitted requests are not disturbed.

Also issue 2's stop check: a server that served requests exits on SIGTERM in under 10 s.
"""

from __future__ import annotations

import signal
import time

import pytest

from .conftest import model_path, start_server
from .streaming import RequestStream


@pytest.fixture(scope="module")
def small_queue_server(tmp_path_factory, request):
    # One request runs at a time and two may wait: the fourth in flight is over the limit.
    srv = start_server(tmp_path_factory.mktemp("backpressure"), model_path(request),
                       step_execution="true", max_num_seqs="1", max_queue="2")
    yield srv
    srv.cleanup()


def test_over_max_queue_is_unavailable_and_admitted_requests_finish(small_queue_server):
    url = small_queue_server.grpc_url
    # Long enough (100 steps at 256x256, seconds on this machine) to still run when "over" arrives.
    running = RequestStream(url).send("running", prompt="a", height=256, width=256, num_inference_steps=100,
                                      preview_interval=1)
    streams = [running]
    try:
        running.wait_first(timeout=60)  # it runs; the next two wait behind it
        waiting = [RequestStream(url).send(f"waiting-{i}", prompt="b", height=32, width=32, num_inference_steps=2)
                   for i in range(2)]
        streams += waiting
        time.sleep(0.3)  # let both be admitted before the one over the limit
        over = RequestStream(url).send("over", prompt="c", height=32, width=32, num_inference_steps=2)
        streams.append(over)
        refused = over.collect(timeout=30)
        assert not refused.responses and len(refused.errors) == 1
        message = refused.error.message()
        assert message.startswith("UNAVAILABLE: [request id: over] ") and "max_queue=2" in message, message
        for stream in [running] + waiting:
            result = stream.collect(timeout=120)
            assert not result.errors and result.num_final == 1, (stream.request_id, result.errors)
            assert result.steps()[-1] == (100 if stream is running else 2)
    finally:
        for stream in streams:
            stream.close()


def test_server_that_served_requests_stops_in_under_10s(small_queue_server):
    start = time.monotonic()
    small_queue_server.send_signal(signal.SIGTERM)
    code = small_queue_server.wait(10.0)
    elapsed = time.monotonic() - start
    assert code == 0, f"exit code {code} after {elapsed:.1f} s\n{small_queue_server.log_tail(20)}"
    log = small_queue_server.log_text()
    assert "qwen_image: shutting down" in log and "qwen_image: stopped" in log
