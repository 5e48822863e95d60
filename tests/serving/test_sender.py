"""The sender thread without Triton: a fake `pb_utils`, and exactly one FINAL response on every path.

Paths: outputs then a final, an engine error, a client cancel (and outputs the engine still
makes afterwards), a failing send, a request refused before or after it was opened, and a
shutdown with streams still open.

No test sleeps to let the sender thread catch up: the fake streams signal when they are sent
to, `drain` returns once the thread has handled everything queued before it, and the slow
encoding holds each response until the test releases it.
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
    """Records every send and signals it (`wait_for`); `cancelled` and `fail_sends` play the client and a
    broken stream; `on_send` runs on the sender thread at each send."""

    def __init__(self, on_send=None):
        self.sent: list[tuple[InferenceResponse, int]] = []
        self.cancelled = False
        self.fail_sends = 0  # the next this many sends raise
        self.on_send = on_send
        self.called = threading.Condition()

    def send(self, response, flags=0):
        with self.called:
            self.called.notify_all()
            if self.on_send is not None:
                self.on_send()
            if self.fail_sends:
                self.fail_sends -= 1
                raise RuntimeError("stream broken")
            self.sent.append((response, flags))

    def wait_for(self, predicate, timeout_s=5.0) -> None:
        """Wait until predicate() holds, checked at each send (the sender thread calls send)."""
        with self.called:
            assert self.called.wait_for(predicate, timeout_s), f"not sent within {timeout_s} s: {self.sent}"

    def is_cancelled(self):
        return self.cancelled

    @property
    def finals(self) -> list[InferenceResponse]:
        return [response for response, flags in self.sent if flags & FINAL]


class FakeMetrics:
    def __init__(self):
        self.outcomes: list[str] = []
        self.first_responses = 0
        self.skip_next = False  # the next outcome is a probe's (`drain`, `settle_encodings`): not recorded

    def request_done(self, outcome, latency_s):
        if self.skip_next:
            self.skip_next = False
            return
        self.outcomes.append(outcome)

    def first_response(self, seconds):
        self.first_responses += 1


IMAGE = OutputSpec("image", "UINT8", (-1, -1, -1, 3), "images", encodings=("png",), pipe_output="images")


def started_sender(outputs: dict, **kwargs) -> ResponseSender:
    """A running sender with fake Triton parts; `.aborted` and `.metrics` record what it did."""
    aborted: list[str] = []
    metrics = FakeMetrics()
    sender = ResponseSender(PB, aborted.extend, metrics, log=lambda line: None, model_name="m",
                            poll_interval_s=0.01, outputs=outputs, **kwargs)
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


def drain(sender, timeout_s=5.0) -> None:
    """Return once the sender thread has handled every message queued before this call (what it would
    send for them, rightly or wrongly, has been sent): a refused request goes through the same FIFO
    queue, and its stream signals when it is answered. Its outcome is not recorded."""
    answered = threading.Event()

    def on_send():
        sender.metrics.skip_next = True  # request_done follows this send on the sender thread
        answered.set()

    sender.reject(FakeResponseSender(on_send), InvalidInputError("prompt", "a probe"), "")
    assert answered.wait(timeout_s), f"the sender thread did not get through its queue in {timeout_s} s"


def test_outputs_then_one_final(sender):
    rs = open_stream(sender)
    sender.enqueue(DiffusionOutput("r", 1, 3, False, outputs=image()))
    sender.enqueue(DiffusionOutput("r", 2, 3, False))
    sender.enqueue(DiffusionOutput("r", 3, 3, True, outputs=image(2)))
    sender.enqueue(DiffusionOutput("r", 3, 3, True, outputs=image()))  # a second final is dropped
    drain(sender)
    assert [flags for _, flags in rs.sent] == [0, 0, FINAL]
    assert rs.sent[0][0].tensors["image"].shape == (1, 8, 8, 3) and "image" not in rs.sent[1][0].tensors
    assert rs.finals[0].tensors["image"].shape == (2, 8, 8, 3) and rs.finals[0].tensors["is_final"].tolist() == [True]
    assert sender.metrics.outcomes == ["success"] and sender.num_open_streams == 0


def test_png_outputs_are_encoded(sender):
    rs = open_stream(sender, output_format="png")
    sender.enqueue(DiffusionOutput("r", 1, 1, True, outputs=image(2)))
    rs.wait_for(lambda: rs.finals)  # encoded on the pool
    drain(sender)
    assert rs.finals[0].tensors["image_png"].shape == (2,) and "image" not in rs.finals[0].tensors


def test_an_engine_error_is_the_one_final(sender):
    rs = open_stream(sender)
    sender.enqueue(DiffusionOutput("r", 1, 3, False))
    sender.enqueue(DiffusionOutput("r", 1, 3, True, error=PipelineError("boom")))
    drain(sender)
    [final] = rs.finals
    assert final.error.code == "INTERNAL" and final.error.message == "INTERNAL: [request id: client-r] boom"
    assert len(rs.sent) == 2 and sender.metrics.outcomes == ["error"]


def test_a_client_cancel_aborts_ends_cancelled_and_drops_later_outputs(sender):
    rs = open_stream(sender)
    sender.enqueue(DiffusionOutput("r", 1, 5, False))
    drain(sender)
    assert len(rs.sent) == 1
    rs.cancelled = True  # the poll notices it
    rs.wait_for(lambda: rs.finals)
    drain(sender)
    assert sender.aborted == ["r"] and rs.finals[0].error.code == "CANCELLED"
    sender.enqueue(DiffusionOutput("r", 2, 5, False))  # made by the engine before it saw the abort
    sender.enqueue(DiffusionOutput("r", 5, 5, True, outputs=image()))
    drain(sender)
    assert len(rs.finals) == 1 and len(rs.sent) == 2
    assert sender.metrics.outcomes == ["cancelled"]


def test_a_failed_intermediate_send_aborts_and_still_ends_the_stream(sender):
    rs = open_stream(sender)
    rs.fail_sends = 1  # e.g. a response that could not be built or sent
    sender.enqueue(DiffusionOutput("r", 1, 5, False, outputs=image()))
    drain(sender)
    assert sender.aborted == ["r"]
    [final] = rs.finals
    assert final.error.code == "INTERNAL" and "could not send a response" in final.error.message
    sender.enqueue(DiffusionOutput("r", 5, 5, True, outputs=image()))  # the engine's final, after the abort
    drain(sender)
    assert len(rs.finals) == 1 and sender.metrics.outcomes == ["error"]


def test_a_response_that_cannot_be_encoded_still_ends_the_stream(sender):
    rs = open_stream(sender, output_format="png")
    bad = {"image": np.zeros((1, 8, 8, 5), dtype=np.uint8)}  # PIL cannot write 5 channels as PNG
    sender.enqueue(DiffusionOutput("r", 1, 1, True, outputs=bad))
    rs.wait_for(lambda: rs.finals)  # the encoding fails on the pool
    drain(sender)
    assert rs.finals[0].error.code == "INTERNAL" and len(rs.sent) == 1


def test_a_stream_that_cannot_be_answered_at_all_is_dropped_without_hanging(sender):
    rs = open_stream(sender)
    rs.fail_sends = 2
    sender.enqueue(DiffusionOutput("r", 1, 5, False))
    drain(sender)
    assert rs.sent == [] and sender.num_open_streams == 0 and sender.aborted == ["r"]


def test_refused_before_and_after_opening(sender):
    rejected = FakeResponseSender()
    sender.reject(rejected, InvalidInputError("height", "33 is bad"), "c1")
    opened = open_stream(sender, "q")
    sender.fail("q", InvalidInputError("seed", "-1 is bad"))
    drain(sender)
    assert rejected.finals[0].error.message == "INVALID_ARG: [request id: c1] input 'height': 33 is bad"
    assert opened.finals[0].error.code == "INVALID_ARG" and len(opened.sent) == 1
    assert sender.metrics.outcomes == ["invalid", "invalid"]


def test_queue_full_counts_as_unavailable_and_long_ids_are_cut(sender):
    opened = open_stream(sender, "q")
    sender.fail("q", EngineUnavailableError("waiting queue is full (max_queue=1)"))
    rejected = FakeResponseSender()
    sender.reject(rejected, InvalidInputError("height", "33 is bad"), "x" * 100_000)
    drain(sender)
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
    """An output encoding ("slow") that holds each response until the test sets `sender.release`, as an
    mp4 of a long video takes seconds; `sender.started` is set when the first one begins. One encoder
    thread, so `settle_encodings` can queue a probe behind the held encodings."""
    from engine_lib.serving import tensors

    started, release = threading.Event(), threading.Event()

    def slow(array, outputs):
        started.set()
        assert release.wait(10), "the test did not release the encoding"
        return np.array([b"encoded"], dtype=np.object_)

    monkeypatch.setitem(tensors.ENCODERS, "slow", slow)
    video = OutputSpec("video", "UINT8", (-1, -1, -1, -1, 3), "videos", encodings=("slow",), pipe_output="frames")
    sender = started_sender({"video": video}, encode_workers=1)
    sender.started, sender.release = started, release
    yield sender
    release.set()  # a failed test may have left an encoding held
    sender.close(timeout_s=5)


def clip():
    return {"video": np.zeros((1, 2, 8, 8, 3), dtype=np.uint8)}


def settle_encodings(sender) -> None:
    """Return once every encoding started so far has finished and the sender thread has handled its
    result: a probe's final, encoded on the one encoder thread behind them (which queues each result
    before it takes the next encoding), has been sent. Its outcome is not recorded."""
    probe = open_stream(sender, "probe", "slow")
    probe.on_send = lambda: setattr(sender.metrics, "skip_next", True)
    sender.enqueue(DiffusionOutput("probe", 1, 1, True, outputs=clip()))
    probe.wait_for(lambda: probe.finals)


def test_a_slow_encoding_holds_neither_other_streams_nor_its_own_order(slow_encoding):
    sender = slow_encoding
    slow, fast = open_stream(sender, "slow", "slow"), open_stream(sender, "fast")
    sender.enqueue(DiffusionOutput("slow", 2, 4, False, outputs=clip()))  # a chunk: its encoding is held
    sender.enqueue(DiffusionOutput("slow", 3, 4, False))  # progress behind it, on the same stream
    sender.enqueue(DiffusionOutput("slow", 4, 4, True, outputs=clip()))
    assert sender.started.wait(5)
    sender.enqueue(DiffusionOutput("fast", 1, 1, True, outputs=image()))
    fast.wait_for(lambda: fast.finals)  # while the slow stream's chunk still encodes
    drain(sender)
    assert slow.sent == []
    sender.release.set()
    slow.wait_for(lambda: slow.finals)
    settle_encodings(sender)
    assert [int(r.tensors["step"][0]) for r, _ in slow.sent] == [2, 3, 4]  # the engine's order
    assert [f for _, f in slow.sent] == [0, 0, FINAL] and slow.finals[0].tensors["video_slow"].tolist() == [b"encoded"]
    assert sorted(sender.metrics.outcomes) == ["success", "success"]


def test_a_cancel_during_an_encoding_ends_the_stream_once(slow_encoding):
    sender = slow_encoding
    rs = open_stream(sender, "r", "slow")
    sender.enqueue(DiffusionOutput("r", 4, 4, True, outputs=clip()))
    assert sender.started.wait(5)
    rs.cancelled = True
    rs.wait_for(lambda: rs.finals)
    sender.release.set()  # the encoding finishes after the cancel: its response is dropped
    settle_encodings(sender)
    assert len(rs.sent) == 1 and rs.finals[0].error.code == "CANCELLED"
    assert sender.metrics.outcomes == ["cancelled"]


def test_shutdown_waits_for_a_final_that_is_encoding(slow_encoding, monkeypatch):
    from engine_lib.serving import sender as sender_module

    sender = slow_encoding
    drain_wait = sender_module.wait

    def release_then_wait(jobs, timeout=None):
        sender.release.set()  # the encoding ends only once the shutdown drain waits for it
        return drain_wait(jobs, timeout=timeout)

    monkeypatch.setattr(sender_module, "wait", release_then_wait)
    rs = open_stream(sender, "r", "slow")
    sender.enqueue(DiffusionOutput("r", 4, 4, True, outputs=clip()))
    assert sender.started.wait(5)
    sender.close(timeout_s=5)
    assert [f for _, f in rs.sent] == [FINAL] and rs.finals[0].error is None
