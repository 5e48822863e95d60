"""Priorities, preemption at step boundaries, shortest-remaining admission, deadlines and the compute
budget through a real tritonserver (step mode, two running slots, max_batch_tokens 128: two 64x64 images
of the tiny model, 64 latent tokens each; `scheduling_policy=shortest_remaining`, which orders requests only
within a priority level, so the priority tests use distinct levels), under `offload=group` (both devices the CPU
here: the code path). Order-based, held by the tick budget: no timing in the asserts."""

from __future__ import annotations

import numpy as np

from tests.helpers.servers import URGENT, module_server
from tests.helpers.streaming import RequestStream, close_all, metric, run_request, scrape, wait_for_metric

LABELS = dict(model="qwen_image")
FIRST = dict(priority=1, parameters=URGENT)  # the most urgent level, with the key that may ask for it


prio_server = module_server("priorities", step_execution="true", max_num_seqs="2", max_batch_tokens="128",
                            max_preemptions="1", scheduling_policy="shortest_remaining", offload="group")


def waiting(server, count: int) -> None:
    assert wait_for_metric(server.metrics_url, "diffusion_requests_waiting", float(count), **LABELS) == count


def fill_both_seats(server, budget, streams: list, **requests: dict) -> None:
    """Send two requests (request id -> inputs) into `streams` and let them take one step together."""
    for request_id, inputs in requests.items():
        streams.append(RequestStream(server.grpc_url).send(request_id, **inputs))
    waiting(server, 2)
    budget.allow(1)
    waiting(server, 0)


def finished_order(streams) -> list[str]:
    for stream in streams:
        result = stream.collect()
        assert not result.errors and result.num_final == 1, (stream.request_id, result.errors)
    return [s.request_id for s in sorted(streams, key=lambda s: s.final_at)]


def test_an_urgent_request_is_admitted_before_an_older_less_urgent_one(prio_server):
    url, budget = prio_server.grpc_url, prio_server.budget.hold()
    preempted_before = metric(scrape(prio_server.metrics_url), "diffusion_preemptions_total", **LABELS)
    streams = []
    try:
        # Two urgent requests fill both slots (as urgent as anything: nothing is preempted).
        fill_both_seats(prio_server, budget, streams, **{"long-a": dict(prompt="a", num_inference_steps=20, **FIRST),
                                                         "long-b": dict(prompt="b", num_inference_steps=30, **FIRST)})
        streams.append(RequestStream(url).send("low", prompt="low", num_inference_steps=2, priority=3))
        waiting(prio_server, 1)
        streams.append(RequestStream(url).send("urgent", prompt="urgent", num_inference_steps=2))  # default 2
        waiting(prio_server, 2)
        assert [wait_for_metric(prio_server.metrics_url, "diffusion_requests_waiting_by_priority", float(n),
                                priority=str(p)) for p, n in ((1, 0), (2, 1), (3, 1))] == [0, 1, 1]
        budget.release()
        order = finished_order(streams)
    finally:
        close_all(streams, budget)
    # FIFO would give the seat "long-a" frees to "low"; the default level (2) is more urgent than 3.
    assert order.index("urgent") < order.index("low"), order
    # ... by admission order, not by pausing "low" after admitting it.
    assert metric(scrape(prio_server.metrics_url), "diffusion_preemptions_total", **LABELS) == preempted_before


def test_a_priority_above_the_levels_is_refused_naming_it(prio_server):
    result = run_request(prio_server.grpc_url, request_id="bad-priority", prompt="x", priority=4)
    message = result.error.message()
    assert message.startswith("INVALID_ARG: [request id: bad-priority] ") and "input 'priority'" in message
    assert "[0, 3]" in message, message


def test_a_preempted_request_resumes_and_equals_its_uninterrupted_run(prio_server):
    url, budget = prio_server.grpc_url, prio_server.budget.hold()
    preempted_before = metric(scrape(prio_server.metrics_url), "diffusion_preemptions_total", **LABELS)
    background = dict(num_inference_steps=6, priority=3, preview_interval=1)
    streams = []
    try:
        streams.append(RequestStream(url).send("bg-1", prompt="first", seed=11, **background))
        streams.append(RequestStream(url).send("bg-2", prompt="second", seed=12, **background))
        waiting(prio_server, 2)
        budget.allow(2)  # both take two steps, then the engine holds
        for stream in streams:
            for _ in range(2):
                stream.wait_first()
        streams.append(RequestStream(url).send("urgent", prompt="now", seed=13, num_inference_steps=2, **FIRST))
        waiting(prio_server, 1)
        budget.release()
        order = finished_order(streams)
    finally:
        close_all(streams, budget)
    assert order[0] == "urgent", order  # it took bg-2's slot at once
    assert metric(scrape(prio_server.metrics_url), "diffusion_preemptions_total", **LABELS) == preempted_before + 1
    paused = streams[1].result
    assert paused.steps() == [1, 2, 3, 4, 5, 6]  # it resumed where it stopped
    solo = run_request(url, prompt="second", seed=12, num_inference_steps=6)
    difference = np.abs(paused.final.as_numpy("image").astype(int) - solo.final.as_numpy("image").astype(int))
    assert difference.max() <= 1, difference.max()
    assert "levers offload=group;" in prio_server.log_text()  # each leaf onloaded as it runs, paused or not


def test_a_short_request_pauses_the_running_one_with_the_most_steps_left(prio_server):
    url, budget = prio_server.grpc_url, prio_server.budget.hold()
    preempted_before = metric(scrape(prio_server.metrics_url), "diffusion_preemptions_total", **LABELS)
    streams = []
    try:
        fill_both_seats(prio_server, budget, streams, **{"long-30": dict(prompt="a", num_inference_steps=30),
                                                         "long-20": dict(prompt="b", num_inference_steps=20)})
        streams.append(RequestStream(url).send("short", prompt="c", num_inference_steps=2))  # same priority
        waiting(prio_server, 1)
        budget.release()
        order = finished_order(streams)
    finally:
        close_all(streams, budget)
    # In arrival order "short" would wait for long-20's seat and finish after it.
    assert order == ["short", "long-20", "long-30"], order
    assert metric(scrape(prio_server.metrics_url), "diffusion_preemptions_total", **LABELS) == preempted_before + 1


def test_a_waiting_short_request_is_admitted_before_an_older_long_one(prio_server):
    url, budget = prio_server.grpc_url, prio_server.budget.hold()
    streams = []
    try:
        # Two urgent requests hold both seats (the waiting ones cannot pause them); one frees its seat soon.
        fill_both_seats(prio_server, budget, streams, **{"urgent-3": dict(prompt="a", num_inference_steps=3, **FIRST),
                                                         "urgent-40": dict(prompt="b", num_inference_steps=40, **FIRST)})
        streams.append(RequestStream(url).send("long", prompt="c", num_inference_steps=12))
        waiting(prio_server, 1)
        streams.append(RequestStream(url).send("short", prompt="d", num_inference_steps=2))
        waiting(prio_server, 2)
        budget.release()
        order = finished_order(streams)
    finally:
        close_all(streams, budget)
    # In arrival order "long" takes the freed seat first and "short" finishes after it.
    assert order.index("short") < order.index("long"), order


def test_a_request_not_started_before_its_timeout_ends_at_once_and_costs_nothing(prio_server):
    url, budget = prio_server.grpc_url, prio_server.budget.hold()
    timed_out_before = metric(scrape(prio_server.metrics_url), "diffusion_requests_total", outcome="timed_out",
                              **LABELS)
    streams = []
    try:
        fill_both_seats(prio_server, budget, streams, **{f"busy-{i}": dict(prompt=f"busy {i}", num_inference_steps=2,
                                                                           **FIRST) for i in range(2)})
        ticks_before = metric(scrape(prio_server.metrics_url), "diffusion_batch_size_count", **LABELS)
        late = RequestStream(url).send("late", prompt="late", num_inference_steps=2, timeout_us=300_000)
        streams.append(late)
        ended = late.collect(timeout=30)  # while the engine is still held: it ended without a step
        assert ended.num_final == 1 and not ended.responses
        message = ended.error.message()
        assert message.startswith("UNAVAILABLE: [request id: late] ") and "timed out" in message, message
        assert wait_for_metric(prio_server.metrics_url, "diffusion_requests_total", timed_out_before + 1,
                               outcome="timed_out", **LABELS) == timed_out_before + 1
        assert metric(scrape(prio_server.metrics_url), "diffusion_batch_size_count", **LABELS) == ticks_before
    finally:
        close_all(streams, budget)


def test_the_compute_budget_limits_the_running_set_and_refuses_a_request_over_it(prio_server):
    url, budget = prio_server.grpc_url, prio_server.budget.hold()
    streams = []
    try:
        # Two images of 64x64: 128 latent tokens each, the whole budget: one runs, one waits.
        streams = [RequestStream(url).send(f"pair-{i}", prompt="pair", num_images=2, num_inference_steps=2)
                   for i in range(2)]
        waiting(prio_server, 2)
        budget.allow(1)
        assert wait_for_metric(prio_server.metrics_url, "diffusion_requests_running", 1.0, **LABELS) == 1
        waiting(prio_server, 1)
        budget.release()
        finished_order(streams)
    finally:
        close_all(streams, budget)
    too_big = run_request(url, request_id="too-big", prompt="x", height=96, width=96)
    message = too_big.error.message()
    assert message.startswith("INVALID_ARG: [request id: too-big] input 'height': ") and \
        "max_batch_tokens=128" in message, message
