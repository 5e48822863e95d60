"""SIGTERM with requests in flight: every request still ends with exactly one final response,
and the process is gone soon after the clients close their streams (docs/serving.md, Shutdown)."""

from __future__ import annotations

import signal
import time

import pytest

from .conftest import model_path, start_server
from .streaming import RequestStream


@pytest.fixture(scope="module")
def doomed_server(tmp_path_factory, request):
    srv = start_server(tmp_path_factory.mktemp("shutdown"), model_path(request), exit_timeout_s=30)
    yield srv
    srv.cleanup()


def test_sigterm_during_four_in_flight_requests(doomed_server):
    streams = [RequestStream(doomed_server.grpc_url).send(f"inflight-{i}", prompt=f"p{i}", height=64, width=64,
                                                          num_inference_steps=30, preview_interval=1)
               for i in range(4)]
    try:
        for stream in streams:
            stream.wait_first(timeout=60)
        doomed_server.send_signal(signal.SIGTERM)
        results = [stream.collect(timeout=60) for stream in streams]
    finally:
        for stream in streams:
            stream.close()
    closed_at = time.monotonic()
    # Triton keeps the model live while these run (exit timeout 30 s): they finish with their image.
    for stream, result in zip(streams, results):
        assert result.num_final == 1, (stream.request_id, len(result.responses), result.errors)
        assert not result.errors, (stream.request_id, result.errors)
        assert result.final.as_numpy("image").shape == (1, 64, 64, 3)
        assert result.steps()[-1] == 30
    code = doomed_server.wait(10.0)
    assert code is not None, f"still running 10 s after the streams closed\n{doomed_server.log_tail(20)}"
    assert time.monotonic() - closed_at < 10.0
    assert "qwen_image: shutting down" in doomed_server.log_text()
