"""SIGTERM with requests running: every request still ends with exactly one final response, and the
process is gone soon after the clients close their streams (docs/serving.md, Shutdown).

Triton keeps the model live while the requests' streams are open, so requests that are still
running at SIGTERM (held by the engine's tick budget: certainly unfinished) finish with their
image once released. The UNAVAILABLE finals of a model that stops with requests open are tested
where they are made: tests/engine (close) and tests/serving/test_sender.py (drain); Triton 2.51
does not call finalize() while a connected client's request is in flight (measured: neither
SIGTERM nor unloading the model in explicit mode does).
"""

from __future__ import annotations

import signal
import time

from tests.helpers.servers import module_server
from tests.helpers.streaming import RequestStream, close_all, run_held


doomed_server = module_server("shutdown", exit_timeout_s=30)


def test_sigterm_during_four_running_requests(doomed_server):
    doomed_server.budget.hold()
    streams = [RequestStream(doomed_server.grpc_url).send(f"inflight-{i}", prompt=f"p{i}", height=64, width=64,
                                                          num_inference_steps=30, preview_interval=1)
               for i in range(4)]
    try:
        run_held(doomed_server, waiting=4, ticks=1)  # all four run one step together, then the engine holds them
        for stream in streams:
            first = stream.wait_first(timeout=60)
            assert not first.errors and first.steps() == [1], (stream.request_id, first.errors)
        doomed_server.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # give a wrong shutdown every chance to cut the requests short
        assert all(s.result.num_final == 0 for s in streams)  # still running at SIGTERM, and after it
        doomed_server.budget.release()
        results = [stream.collect(timeout=60) for stream in streams]
    finally:
        close_all(streams, doomed_server.budget)
    closed_at = time.monotonic()
    # Triton keeps the model live while these run (exit timeout 30 s): they finish with their image.
    for stream, result in zip(streams, results):
        assert result.num_final == 1, (stream.request_id, len(result.responses), result.errors)
        assert not result.errors, (stream.request_id, result.errors)
        assert result.final.as_numpy("image").shape == (1, 64, 64, 3)
        assert result.steps() == list(range(1, 31))
    code = doomed_server.wait(10.0)
    assert code is not None, f"still running 10 s after the streams closed\n{doomed_server.log_tail(20)}"
    assert time.monotonic() - closed_at < 10.0
    assert "qwen_image: shutting down" in doomed_server.log_text()
