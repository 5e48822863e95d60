"""Over max_queue a request is refused with UNAVAILABLE (gRPC and HTTP); admitted requests are not
disturbed; the refusals are counted as `unavailable`.

The running request is held by the engine's tick budget, so the queue is certainly full when the
request over the limit arrives. Also issue 2's stop check: a server that served requests exits on
SIGTERM in under 10 s.
"""

from __future__ import annotations

import signal
import time

from tests.helpers.servers import module_server
from tests.helpers.streaming import RequestStream, close_all, metric, post_json, run_held, scrape, wait_for_metric

LABELS = dict(model="qwen_image", outcome="unavailable")


# One request runs at a time and two may wait: a fourth in flight is over the limit.
small_queue_server = module_server("backpressure", step_execution="true", max_num_seqs="1", max_queue="2")


def test_over_max_queue_is_unavailable_and_admitted_requests_finish(small_queue_server):
    server, url = small_queue_server, small_queue_server.grpc_url
    rejected_before = metric(scrape(server.metrics_url), "diffusion_requests_total", **LABELS)
    server.budget.hold()
    running = RequestStream(url).send("running", prompt="a", height=64, width=64, num_inference_steps=4,
                                      preview_interval=1)
    streams = [running]
    try:
        run_held(server, waiting=1, ticks=1)
        running.wait_first(timeout=60)  # it runs one step; the engine holds it there
        waiting = [RequestStream(url).send(f"waiting-{i}", prompt="b", height=32, width=32, num_inference_steps=2)
                   for i in range(2)]
        streams += waiting
        run_held(server, waiting=2, ticks=0)  # both wait behind it: the queue is full
        over = RequestStream(url).send("over", prompt="c", height=32, width=32, num_inference_steps=2)
        streams.append(over)
        refused = over.collect(timeout=30)
        assert not refused.responses and len(refused.errors) == 1
        message = refused.error.message()
        assert message.startswith("UNAVAILABLE: [request id: over] ") and "max_queue=2" in message, message
        # HTTP generate_stream answers the same refusal with 400 and the message.
        status, reply = post_json(f"http://{server.http_url}/v2/models/qwen_image/generate_stream",
                                  {"prompt": "http over", "height": 32, "width": 32})
        assert status == 400 and b"UNAVAILABLE: " in reply and b"max_queue=2" in reply, (status, reply)
        server.budget.release()
        for stream in [running] + waiting:
            result = stream.collect(timeout=120)
            assert not result.errors and result.num_final == 1, (stream.request_id, result.errors)
            assert result.steps() == ([1, 2, 3, 4] if stream is running else [2])
    finally:
        close_all(streams, server.budget)
    assert wait_for_metric(server.metrics_url, "diffusion_requests_total", rejected_before + 2,
                           **LABELS) == rejected_before + 2


def test_server_that_served_requests_stops_in_under_10s(small_queue_server):
    start = time.monotonic()
    small_queue_server.send_signal(signal.SIGTERM)
    code = small_queue_server.wait(10.0)
    elapsed = time.monotonic() - start
    assert code == 0, f"exit code {code} after {elapsed:.1f} s\n{small_queue_server.log_tail(20)}"
    log = small_queue_server.log_text()
    assert "qwen_image: shutting down" in log and "qwen_image: stopped" in log
