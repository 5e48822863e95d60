"""gRPC streams through `make serve`'s launcher and its gate (engine_lib/serving/grpc_gate.py): a client that
stops reading costs bounded memory and still gets every final; SIGTERM ends idle streams at once, ends each
request still running after the gate's drain with one UNAVAILABLE final naming the shutdown, and the launcher
exits 0 with every model unloaded.

One launcher for the module, with a small unsent bound (a few megabytes of previews overflow it) and a short
exit timeout; the last test stops it with SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import queue
import re
import signal
import threading
import time

import grpc
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from engine_lib.serving.serve import GATE_DRAIN_MARGIN_S
from tests.helpers.launched import MODEL, command_lines, module_launcher, raw_post, rss_bytes
from tests.helpers.servers import running
from tests.helpers.streaming import (RequestStream, is_final_response, make_inputs, metric, run_concurrently, scrape,
                                     wait_for_metric)

MAX_UNSENT = 256 * 1024  # GRPC_MAX_UNSENT_BYTES of this launcher's gate
EXIT_TIMEOUT_S = 10  # EXIT_TIMEOUT_SECS: the gate's drain is GATE_DRAIN_MARGIN_S shorter
DRAIN_S = EXIT_TIMEOUT_S - GATE_DRAIN_MARGIN_S
# What the gate's or tritonserver's RSS may grow by besides the bound while the client reads nothing: their own
# allocations for the load (tritonserver: 10-15 MiB measured, with or without the bound). A ceiling against
# gross growth (a stalled stream grew tritonserver by 87 to 380 MB in 44 s); at the 11 MB this test sends, the
# count of dropped previews is the precise check.
RSS_SLACK = 64 * 1024 * 1024


launcher = module_launcher("streams", env={"GRPC_MAX_UNSENT_BYTES": str(MAX_UNSENT),
                                           "EXIT_TIMEOUT_SECS": str(EXIT_TIMEOUT_S)})


def _pids(launcher) -> dict[str, int]:
    """The gate's and tritonserver's pids."""
    found = {name: pid for name, pid in launcher.pids().items() if name in ("gate", "tritonserver")}
    assert set(found) == {"gate", "tritonserver"}, found
    return found


def _successes(launcher) -> float:
    return metric(scrape(launcher.metrics_url), "diffusion_requests_total", model=MODEL, outcome="success")


def _log_match(launcher, pattern: str, after: int, timeout: float = 10.0) -> list[str]:
    """Waits until `pattern` appears in the launcher's tritonserver log past its first `after` bytes; every match
    there (an earlier stream's line may still come after `after`: the gate writes it once that stream ends)."""
    deadline = time.monotonic() + timeout
    while True:
        found = re.findall(pattern, launcher.triton_log.read_bytes()[after:].decode(errors="replace"))
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_a_client_that_stops_reading_costs_bounded_memory_and_gets_every_final(launcher):
    """Two requests on one stream whose callback blocks until the model has sent everything: about 11 MB of
    previews against a 256 KiB bound."""
    steps, requests = 30, 2
    size = {"height": 128, "width": 128, "num_images": 4}
    warm = run_concurrently(launcher.grpc_url, [dict(prompt="warm", num_inference_steps=4, preview_interval=1, **size)]
                            * requests)  # the same load, read: tritonserver's allocations for it are made
    assert all(result.num_final == 1 and not result.errors for result in warm)
    log_size = launcher.triton_log.stat().st_size
    pids = _pids(launcher)
    before = {name: rss_bytes(pid) for name, pid in pids.items()}
    peak = dict(before)
    reading = threading.Event()
    received: "queue.Queue[tuple]" = queue.Queue()

    def on_response(result, error) -> None:
        reading.wait()  # a client that stops reading: tritonclient's stream thread is stuck here
        received.put((result, error))

    # Without BDP probing the client takes no more than 64 KiB beyond the message it holds: the rest waits
    # in the gate or in tritonserver.
    client = grpcclient.InferenceServerClient(launcher.grpc_url, channel_args=[
        ("grpc.http2.bdp_probe", 0), ("grpc.max_receive_message_length", -1)])
    client.start_stream(callback=on_response)
    try:
        successes = _successes(launcher)
        for i in range(requests):
            client.async_stream_infer(MODEL, make_inputs(prompt=f"slow reader {i}", num_inference_steps=steps,
                                                         preview_interval=1, **size),
                                      request_id=f"slow-{i}", enable_empty_final_response=True)
        deadline = time.monotonic() + 180
        while _successes(launcher) < successes + requests:  # every response sent by the model, none read
            assert time.monotonic() < deadline, "the requests did not finish"
            peak = {name: max(peak[name], rss_bytes(pid)) for name, pid in pids.items()}
            time.sleep(0.1)
        time.sleep(1.0)  # what tritonserver still holds reaches the gate, or stays where it is
        peak = {name: max(peak[name], rss_bytes(pid)) for name, pid in pids.items()}
        reading.set()
        previews, finals = {f"slow-{i}": [] for i in range(requests)}, {f"slow-{i}": [] for i in range(requests)}
        while sum(map(len, finals.values())) < requests:
            result, error = received.get(timeout=60)
            assert error is None, error
            request_id = result.get_response().id
            (finals if is_final_response(result) else previews)[request_id].append(result)
        with contextlib.suppress(queue.Empty):
            raise AssertionError(f"a response after both finals: {received.get(timeout=0.5)}")
    finally:
        reading.set()
        client.stop_stream()
        client.close()
    growth = {name: peak[name] - before[name] for name in pids}
    print(f"RSS growth while unread: gate {growth['gate'] / 2**20:.1f} MiB, tritonserver "
          f"{growth['tritonserver'] / 2**20:.1f} MiB; previews received "
          f"{ {name: len(items) for name, items in previews.items()} } of {steps - 1} each")
    for request_id in finals:
        assert len(finals[request_id]) == 1, request_id
        assert finals[request_id][0].as_numpy("image").shape == (4, 128, 128, 3)
        shown = [int(r.as_numpy("step")[0]) for r in previews[request_id]]
        assert shown == sorted(shown) and len(set(shown)) == len(shown) and max(shown, default=0) < steps
    for name in pids:
        assert growth[name] < MAX_UNSENT + RSS_SLACK, (name, growth)
    expected = requests * (steps - 1) - sum(map(len, previews.values()))
    dropped = _log_match(launcher, rf"grpc gate: a stream ended with {expected} intermediate responses dropped",
                         log_size)
    assert expected > 0 and dropped, (expected, _log_match(launcher, r"a stream ended with (\d+)", log_size, 0))


def _raw_request(request_id: str, **inputs) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=MODEL, id=request_id)
    for tensor in make_inputs(**inputs):
        request.inputs.append(tensor._get_tensor())
        request.raw_input_contents.append(tensor._get_content())
    return request


def test_sigterm_to_the_whole_tree_ends_idle_streams_at_once_and_running_requests_with_one_final(launcher):
    """Stops the module's launcher with SIGTERM to every process of its tree at once (systemd's control-group kill,
    `docker stop` of a container whose init is not the launcher): tritonserver, the gate and the front door get it
    too. One idle stream (its request finished), and four requests held in the engine (three gRPC streams, one
    front door request): each gets one final naming the shutdown after the gate's drain, tritonserver waits for
    them (its exit timeout is EXIT_TIMEOUT_SECS, not cut short under them: it crashed), and nothing is left."""
    channel = grpc.insecure_channel(launcher.grpc_url)
    outgoing: "queue.Queue" = queue.Queue()
    idle = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter(outgoing.get, None))
    outgoing.put(_raw_request("idle", prompt="done", num_inference_steps=2, height=32, width=32))
    first = next(idle)
    assert not first.error_message and first.infer_response.parameters["triton_final_response"].bool_param
    idle_end: dict = {}

    def read_idle() -> None:
        try:
            idle_end["rest"] = list(idle)  # until the gate ends the stream
        except grpc.RpcError as exc:
            idle_end["error"] = exc
        idle_end["at"] = time.monotonic()

    launcher.budget.hold()
    busy, *others = [RequestStream(launcher.grpc_url).send(name, prompt="held", num_inference_steps=50, height=32,
                                                           width=32) for name in ("busy", "busy-2", "busy-3")]
    front: dict = {}  # a front door request, held too: it reaches tritonserver through the gate
    body = json.dumps({"prompt": "held", "num_inference_steps": 50, "height": 32, "width": 32}).encode()
    front_door = threading.Thread(target=lambda: front.update(reply=raw_post(
        launcher.front, f"/v2/models/{MODEL}/generate", body, timeout=EXIT_TIMEOUT_S + 30)))
    front_door.start()
    try:
        assert wait_for_metric(launcher.metrics_url, "diffusion_requests_waiting", 4.0, model=MODEL) == 4.0
        reader = threading.Thread(target=read_idle)
        reader.start()
        start = time.monotonic()
        tree = launcher.signal_tree(signal.SIGTERM)
        result = busy.collect(timeout=EXIT_TIMEOUT_S + 30)
        other_results = [other.collect(timeout=EXIT_TIMEOUT_S + 30) for other in others]
        code = launcher.process.wait(timeout=EXIT_TIMEOUT_S + 30)
        took = time.monotonic() - start
        reader.join(10)
        front_door.join(10)
    finally:
        outgoing.put(None)
        for stream in (busy, *others):
            stream.close()
        channel.close()
    print(f"idle stream ended {idle_end['at'] - start:.1f} s after SIGTERM, the running request's final came "
          f"{busy.final_at - start:.1f} s after, the launcher exited after {took:.1f} s")
    assert code == 0, launcher.log()[-3000:]
    assert idle_end == {"rest": [], "at": idle_end["at"]}, idle_end  # status OK, nothing more
    assert idle_end["at"] - start < DRAIN_S - 2.0  # at once, not with the running request
    assert result.num_final == 1 and not result.responses, (result.responses, result.errors)
    assert "UNAVAILABLE: [request id: busy] server shutting down" in str(result.error)
    for other, other_result in zip(others, other_results):
        assert other_result.num_final == 1 and not other_result.responses, other_result.errors
        assert f"UNAVAILABLE: [request id: {other.request_id}] server shutting down" in str(other_result.error)
    assert busy.final_at - start >= DRAIN_S - 1.0  # it had the drain to finish
    status, reply = front["reply"]
    assert status == 503 and b"server shutting down" in reply, (status, reply)
    assert took < EXIT_TIMEOUT_S + 10.0
    triton_log = launcher.triton_log.read_text(errors="replace")
    assert f"successfully unloaded '{MODEL}'" in triton_log and f"{MODEL}: stopped" in triton_log
    assert "Exiting immediately" not in triton_log and "Signal (11)" not in triton_log
    assert f"grpc gate: 4 requests still running after the {DRAIN_S:g} s drain ended with UNAVAILABLE" in triton_log
    left = [pid for pid in tree if running(pid)]
    assert not left, f"left running: {[(pid, command_lines().get(pid)) for pid in left]}"
