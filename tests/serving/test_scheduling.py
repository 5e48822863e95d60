"""Admission order through a real tritonserver (step mode, two running slots): a request of another
size joins the running batch, and a short compatible request passes an incompatible head instead of
waiting behind it. Order-based, held by the tick budget."""

from __future__ import annotations

from .conftest import module_server
from .streaming import RequestStream, close_all, run_held, wait_for_metric


step_server = module_server("scheduling", step_execution="true", max_num_seqs="2", mixed_size_batching="true")


def final_order(streams: list[RequestStream]) -> list[str]:
    """Request ids in the order their final responses (or errors) arrived, as timed by each stream's
    callback (polling would see a stream with many progress responses queued late)."""
    for stream in streams:
        stream.collect(settle_s=0)
    return [stream.request_id for stream in sorted(streams, key=lambda stream: stream.final_at)]


def test_a_request_of_another_size_joins_the_running_batch(step_server):
    """Qwen-Image batches different sizes in one forward: a short 64x64 request does not wait for a
    long-running 32x32 one (both run at once) and finishes first."""
    budget = step_server.budget.hold()
    streams = [RequestStream(step_server.grpc_url).send("long-32", prompt="long", height=32, width=32,
                                                        num_inference_steps=30)]
    try:
        run_held(step_server, waiting=1, ticks=1)
        assert wait_for_metric(step_server.metrics_url, "diffusion_requests_running", 1.0, model="qwen_image") == 1
        streams.append(RequestStream(step_server.grpc_url).send("short-64", prompt="short", height=64, width=64,
                                                                 num_inference_steps=2))
        run_held(step_server, waiting=1, ticks=1)
        assert wait_for_metric(step_server.metrics_url, "diffusion_requests_running", 2.0, model="qwen_image") == 2
        budget.allow(3)  # enough for "short-64" (one step left), far from enough for "long-32" (28 left)
        streams[1].collect(settle_s=0)
        assert streams[0].final_at is None, "long-32 finished within three ticks"
        budget.release()
        order = final_order(streams)
    finally:
        close_all(streams, budget)
    assert order == ["short-64", "long-32"]
    for stream in streams:
        assert not stream.result.errors and stream.result.num_final == 1, stream.result.errors
    assert streams[1].result.final.as_numpy("image").shape == (1, 64, 64, 3)


def test_a_compatible_request_passes_an_incompatible_head(step_server):
    budget = step_server.budget.hold()
    long = RequestStream(step_server.grpc_url).send("long", prompt="long", height=32, width=32,
                                                      num_inference_steps=30)
    streams = [long]
    try:
        run_held(step_server, waiting=1, ticks=1)  # "long" runs alone, then the engine holds
        assert wait_for_metric(step_server.metrics_url, "diffusion_requests_running", 1.0, model="qwen_image") == 1
        # True CFG: another step key than the running request's (sizes no longer split Qwen-Image batches).
        streams.append(RequestStream(step_server.grpc_url).send("head", prompt="head", height=32, width=32,
                                                                 num_inference_steps=10, negative_prompt="blurry",
                                                                 true_cfg_scale=4.0))
        assert wait_for_metric(step_server.metrics_url, "diffusion_requests_waiting", 1.0, model="qwen_image") == 1
        streams.append(RequestStream(step_server.grpc_url).send("short", prompt="short", height=32, width=32,
                                                                 num_inference_steps=2))
        assert wait_for_metric(step_server.metrics_url, "diffusion_requests_waiting", 2.0, model="qwen_image") == 2
        budget.allow(4)  # "short" needs two ticks beside "long"; "long" needs 29 more
        streams[2].collect(settle_s=0)
        assert streams[0].final_at is None and streams[1].final_at is None
        budget.release()  # "head" (10 steps) can start only once "long" has drained
        order = final_order(streams)
    finally:
        close_all(streams, budget)
    # FIFO would run "short" only after "head", which waits for "long" to drain.
    assert order == ["short", "long", "head"]
    for stream in streams:
        assert not stream.result.errors and stream.result.num_final == 1, stream.result.errors
