"""The sender thread without Triton: a fake `pb_utils`, and exactly one FINAL response on every path.

Paths: outputs then a final, an engine error, a client cancel (and outputs the engine still
makes afterwards), a failing send, a request refused before or after it was opened, and a
shutdown with streams still open.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from engine_lib.interface import OutputSpec
from engine_lib.request import DiffusionOutput, EngineUnavailableError, InvalidInputError, PipelineError
from engine_lib.serving.sender import OpenStream, ResponseSender

FINAL = 1


class TritonError:
    INVALID_ARG, CANCELLED, UNAVAILABLE, INTERNAL = "INVALID_ARG", "CANCELLED", "UNAVAILABLE", "INTERNAL"

    def __init__(self, message, code):
        self.message, self.code = message, code


class InferenceResponse:
    def __init__(self, output_tensors=(), error=None):
        self.tensors = {t.name: t.array for t in output_tensors}
        self.error = error


PB = SimpleNamespace(TritonError=TritonError, InferenceResponse=InferenceResponse,
                     Tensor=lambda name, array: SimpleNamespace(name=name, array=array),
                     TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL)


class FakeResponseSender:
    """Records every send; `cancelled` and `fail_sends` play the client and a broken stream."""

    def __init__(self):
        self.sent: list[tuple[InferenceResponse, int]] = []
        self.cancelled = False
        self.fail_sends = 0  # the next this many sends raise

    def send(self, response, flags=0):
        if self.fail_sends:
            self.fail_sends -= 1
            raise RuntimeError("stream broken")
        self.sent.append((response, flags))

    def is_cancelled(self):
        return self.cancelled

    @property
    def finals(self) -> list[InferenceResponse]:
        return [response for response, flags in self.sent if flags & FINAL]


class FakeMetrics:
    def __init__(self):
        self.outcomes: list[str] = []
        self.first_responses = 0

    def request_done(self, outcome, latency_s):
        self.outcomes.append(outcome)

    def first_response(self, seconds):
        self.first_responses += 1


IMAGE = OutputSpec("image", "UINT8", (-1, -1, -1, 3), "images", encodings=("png",), pipe_output="images")


def started_sender(outputs: dict) -> ResponseSender:
    """A running sender with fake Triton parts; `.aborted` and `.metrics` record what it did."""
    aborted: list[str] = []
    metrics = FakeMetrics()
    sender = ResponseSender(PB, aborted.extend, metrics, log=lambda line: None, model_name="m",
                            poll_interval_s=0.01, outputs=outputs)
    sender.aborted, sender.metrics = aborted, metrics
    sender.start()
    return sender


@pytest.fixture
def sender():
    sender = started_sender({"image": IMAGE})
    yield sender
    sender.close(timeout_s=5)


def open_stream(sender, request_id="r", output_format="raw") -> FakeResponseSender:
    response_sender = FakeResponseSender()
    sender.open(OpenStream(request_id, f"client-{request_id}", response_sender, output_format, time.monotonic()))
    return response_sender


def image(rows=1):
    return {"image": np.zeros((rows, 8, 8, 3), dtype=np.uint8)}


def settle(sender, predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.005)
    assert predicate()
    time.sleep(0.05)  # anything the thread would (wrongly) still send comes now


def test_outputs_then_one_final(sender):
    rs = open_stream(sender)
    sender.enqueue(DiffusionOutput("r", 1, 3, False, outputs=image()))
    sender.enqueue(DiffusionOutput("r", 2, 3, False))
    sender.enqueue(DiffusionOutput("r", 3, 3, True, outputs=image(2)))
    sender.enqueue(DiffusionOutput("r", 3, 3, True, outputs=image()))  # a second final is dropped
    settle(sender, lambda: rs.finals)
    assert [flags for _, flags in rs.sent] == [0, 0, FINAL]
    assert rs.sent[0][0].tensors["image"].shape == (1, 8, 8, 3) and "image" not in rs.sent[1][0].tensors
    assert rs.finals[0].tensors["image"].shape == (2, 8, 8, 3) and rs.finals[0].tensors["is_final"].tolist() == [True]
    assert sender.metrics.outcomes == ["success"] and sender.num_open_streams == 0


def test_png_outputs_are_encoded(sender):
    rs = open_stream(sender, output_format="png")
    sender.enqueue(DiffusionOutput("r", 1, 1, True, outputs=image(2)))
    settle(sender, lambda: rs.finals)
    assert rs.finals[0].tensors["image_png"].shape == (2,) and "image" not in rs.finals[0].tensors


def test_an_engine_error_is_the_one_final(sender):
    rs = open_stream(sender)
    sender.enqueue(DiffusionOutput("r", 1, 3, False))
    sender.enqueue(DiffusionOutput("r", 1, 3, True, error=PipelineError("boom")))
    settle(sender, lambda: rs.finals)
    [final] = rs.finals
    assert final.error.code == "INTERNAL" and final.error.message == "INTERNAL: [request id: client-r] boom"
    assert len(rs.sent) == 2 and sender.metrics.outcomes == ["error"]


def test_a_client_cancel_aborts_ends_cancelled_and_drops_later_outputs(sender):
    rs = open_stream(sender)
    sender.enqueue(DiffusionOutput("r", 1, 5, False))
    settle(sender, lambda: rs.sent)
    rs.cancelled = True  # the poll notices it
    settle(sender, lambda: rs.finals)
    assert sender.aborted == ["r"] and rs.finals[0].error.code == "CANCELLED"
    sender.enqueue(DiffusionOutput("r", 2, 5, False))  # made by the engine before it saw the abort
    sender.enqueue(DiffusionOutput("r", 5, 5, True, outputs=image()))
    settle(sender, lambda: True)
    assert len(rs.finals) == 1 and len(rs.sent) == 2
    assert sender.metrics.outcomes == ["cancelled"]


def test_a_failed_intermediate_send_aborts_and_still_ends_the_stream(sender):
    rs = open_stream(sender)
    rs.fail_sends = 1  # e.g. a response that could not be built or sent
    sender.enqueue(DiffusionOutput("r", 1, 5, False, outputs=image()))
    settle(sender, lambda: rs.finals)
    assert sender.aborted == ["r"]
    [final] = rs.finals
    assert final.error.code == "INTERNAL" and "could not send a response" in final.error.message
    sender.enqueue(DiffusionOutput("r", 5, 5, True, outputs=image()))  # the engine's final, after the abort
    settle(sender, lambda: True)
    assert len(rs.finals) == 1 and sender.metrics.outcomes == ["error"]


def test_a_response_that_cannot_be_encoded_still_ends_the_stream(sender):
    rs = open_stream(sender, output_format="png")
    bad = {"image": np.zeros((1, 8, 8, 5), dtype=np.uint8)}  # PIL cannot write 5 channels as PNG
    sender.enqueue(DiffusionOutput("r", 1, 1, True, outputs=bad))
    settle(sender, lambda: rs.finals)
    assert rs.finals[0].error.code == "INTERNAL" and len(rs.sent) == 1


def test_a_stream_that_cannot_be_answered_at_all_is_dropped_without_hanging(sender):
    rs = open_stream(sender)
    rs.fail_sends = 2
    sender.enqueue(DiffusionOutput("r", 1, 5, False))
    settle(sender, lambda: sender.metrics.outcomes)
    assert rs.sent == [] and sender.num_open_streams == 0 and sender.aborted == ["r"]


def test_refused_before_and_after_opening(sender):
    rejected = FakeResponseSender()
    sender.reject(rejected, InvalidInputError("height", "33 is bad"), "c1")
    opened = open_stream(sender, "q")
    sender.fail("q", InvalidInputError("seed", "-1 is bad"))
    settle(sender, lambda: rejected.finals and opened.finals)
    assert rejected.finals[0].error.message == "INVALID_ARG: [request id: c1] input 'height': 33 is bad"
    assert opened.finals[0].error.code == "INVALID_ARG" and len(opened.sent) == 1
    assert sender.metrics.outcomes == ["invalid", "invalid"]


def test_queue_full_counts_as_unavailable_and_long_ids_are_cut(sender):
    opened = open_stream(sender, "q")
    sender.fail("q", EngineUnavailableError("waiting queue is full (max_queue=1)"))
    rejected = FakeResponseSender()
    sender.reject(rejected, InvalidInputError("height", "33 is bad"), "x" * 100_000)
    settle(sender, lambda: rejected.finals and opened.finals)
    assert sender.metrics.outcomes == ["unavailable", "invalid"]
    message = rejected.finals[0].error.message
    assert len(message) < 300 and message.startswith("INVALID_ARG: [request id: " + "x" * 128 + "...]")


def test_shutdown_sends_what_is_queued_then_ends_open_streams_unavailable():
    metrics = FakeMetrics()
    sender = ResponseSender(PB, lambda ids: None, metrics, log=lambda line: None, model_name="m",
                            outputs={"image": IMAGE})
    done, still_open = FakeResponseSender(), FakeResponseSender()
    # Queued before the thread starts: close() must drain them before ending what is still open.
    sender.open(OpenStream("done", "", done, "raw", time.monotonic()))
    sender.open(OpenStream("open", "", still_open, "raw", time.monotonic()))
    sender.enqueue(DiffusionOutput("done", 2, 2, True, outputs=image()))
    sender.enqueue(DiffusionOutput("open", 1, 9, False))
    sender.start()
    sender.close(timeout_s=5)
    assert not any(t.name == "m-sender" for t in threading.enumerate())
    assert [f for _, f in done.sent] == [FINAL] and done.finals[0].error is None
    assert [f for _, f in still_open.sent] == [0, FINAL]
    assert still_open.finals[0].error.code == "UNAVAILABLE" and "shutting down" in still_open.finals[0].error.message
    assert sorted(metrics.outcomes) == ["error", "success"]


@pytest.fixture
def slow_encoding(monkeypatch):
    """An output encoding ("slow") that takes 0.5 s per response, as an mp4 of a long video does."""
    from engine_lib.serving import tensors

    started = threading.Event()

    def slow(array, outputs):
        started.set()
        time.sleep(0.5)
        return np.array([b"encoded"], dtype=np.object_)

    monkeypatch.setitem(tensors.ENCODERS, "slow", slow)
    video = OutputSpec("video", "UINT8", (-1, -1, -1, -1, 3), "videos", encodings=("slow",), pipe_output="frames")
    sender = started_sender({"video": video})
    sender.started = started
    yield sender
    sender.close(timeout_s=5)


def clip():
    return {"video": np.zeros((1, 2, 8, 8, 3), dtype=np.uint8)}


def test_a_slow_encoding_holds_neither_other_streams_nor_its_own_order(slow_encoding):
    sender = slow_encoding
    slow, fast = open_stream(sender, "slow", "slow"), open_stream(sender, "fast")
    sender.enqueue(DiffusionOutput("slow", 2, 4, False, outputs=clip()))  # a chunk: encodes for 0.5 s
    sender.enqueue(DiffusionOutput("slow", 3, 4, False))  # progress behind it, on the same stream
    sender.enqueue(DiffusionOutput("slow", 4, 4, True, outputs=clip()))
    assert sender.started.wait(5)
    sender.enqueue(DiffusionOutput("fast", 1, 1, True, outputs=image()))
    settle(sender, lambda: fast.finals, timeout=0.4)  # while the slow stream's chunk still encodes
    assert slow.sent == []
    settle(sender, lambda: slow.finals)
    assert [int(r.tensors["step"][0]) for r, _ in slow.sent] == [2, 3, 4]  # the engine's order
    assert [f for _, f in slow.sent] == [0, 0, FINAL] and slow.finals[0].tensors["video_slow"].tolist() == [b"encoded"]
    assert sorted(sender.metrics.outcomes) == ["success", "success"]


def test_a_cancel_during_an_encoding_ends_the_stream_once(slow_encoding):
    sender = slow_encoding
    rs = open_stream(sender, "r", "slow")
    sender.enqueue(DiffusionOutput("r", 4, 4, True, outputs=clip()))
    assert sender.started.wait(5)
    rs.cancelled = True
    settle(sender, lambda: rs.finals)
    time.sleep(0.6)  # the encoding finishes after the cancel: its response is dropped
    assert len(rs.sent) == 1 and rs.finals[0].error.code == "CANCELLED"
    assert sender.metrics.outcomes == ["cancelled"]


def test_shutdown_waits_for_a_final_that_is_encoding(slow_encoding):
    sender = slow_encoding
    rs = open_stream(sender, "r", "slow")
    sender.enqueue(DiffusionOutput("r", 4, 4, True, outputs=clip()))
    assert sender.started.wait(5)
    sender.close(timeout_s=5)
    assert [f for _, f in rs.sent] == [FINAL] and rs.finals[0].error is None
