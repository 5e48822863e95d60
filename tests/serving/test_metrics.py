"""Custom metrics on Triton's /metrics port move with traffic, and the gauges say what the engine holds."""

from __future__ import annotations

import time

import numpy as np

from tests.helpers.streaming import RequestStream, close_all, metric, run_held, run_request, scrape, wait_for_metric

LABELS = {"model": "qwen_image"}


def test_counters_and_histograms_move(server):
    before = scrape(server.metrics_url)
    ok = run_request(server.grpc_url, prompt="metrics", height=32, width=32, num_inference_steps=2)
    bad = run_request(server.grpc_url, prompt="metrics", height=33)
    assert ok.num_final == 1 and not ok.errors and bad.errors

    for outcome in ("success", "invalid"):
        expected = metric(before, "diffusion_requests_total", outcome=outcome, **LABELS) + 1
        assert wait_for_metric(server.metrics_url, "diffusion_requests_total", expected, outcome=outcome,
                               **LABELS) == expected, outcome
    after = scrape(server.metrics_url)
    for histogram in ("diffusion_batch_size", "diffusion_tick_seconds", "diffusion_time_to_first_response_seconds",
                      "diffusion_request_latency_seconds"):
        assert metric(after, f"{histogram}_count", **LABELS) > metric(before, f"{histogram}_count", **LABELS), histogram
        assert metric(after, f"{histogram}_sum", **LABELS) > metric(before, f"{histogram}_sum", **LABELS), histogram
    # Triton's own per-model counters count the request too.
    assert metric(after, "nv_inference_request_success", model="qwen_image", version="1") > 0


def test_first_block_cache_decisions_are_counted(server):
    """One request with the cache on: one decision per step (no CFG), at least its first step computed and, at
    threshold 0.5 on the tiny model, some reused."""
    before = scrape(server.metrics_url)
    result = run_request(server.grpc_url, prompt="a cat", height=64, width=64, num_inference_steps=6, seed=3,
                         cache="first_block", cache_threshold=0.5)
    assert result.num_final == 1 and not result.errors
    total = metric(before, "diffusion_cache_steps_total", **LABELS) + 6
    assert wait_for_metric(server.metrics_url, "diffusion_cache_steps_total", total, **LABELS) == total
    after = scrape(server.metrics_url)
    for outcome in ("computed", "reused"):
        assert metric(after, "diffusion_cache_steps_total", outcome=outcome, **LABELS) > \
            metric(before, "diffusion_cache_steps_total", outcome=outcome, **LABELS), outcome


def test_gauges_show_running_and_waiting_requests_then_nothing(server, held):
    """With max_num_seqs 4 and the engine held after one step: 4 running (each with runner state and an open
    stream), 2 waiting; once released and done, every gauge is back to 0. Which 4 run is the order the
    six streams reached the engine, not necessarily the order they were sent in."""
    held.hold()
    streams = [RequestStream(server.grpc_url).send(f"g{i}", prompt=f"gauge {i}", height=32, width=32,
                                                   num_inference_steps=3, preview_interval=1) for i in range(6)]
    try:
        run_held(server, waiting=6, ticks=1)
        expected = {"diffusion_requests_running": 4.0, "diffusion_requests_waiting": 2.0,
                    "diffusion_runner_states": 4.0, "diffusion_open_streams": 6.0}
        for gauge, value in expected.items():
            assert wait_for_metric(server.metrics_url, gauge, value, **LABELS) == value, gauge
        deadline = time.monotonic() + 60
        while sum(stream.has_response() for stream in streams) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        started = [stream for stream in streams if stream.has_response()]
        assert len(started) == 4, [stream.request_id for stream in started]
        for stream in started:
            assert stream.wait_first(timeout=10).steps() == [1]
        held.release()
        assert all(stream.collect(timeout=120).num_final == 1 for stream in streams)
    finally:
        close_all(streams, held)
    for gauge in expected:
        assert wait_for_metric(server.metrics_url, gauge, 0.0, **LABELS) == 0.0, gauge


def test_prompt_cache_hits_and_engine_phases_are_counted(server):
    labels = {"model": "qwen_image"}
    before = scrape(server.metrics_url)
    prompt = f"a cached prompt {time.monotonic()}"  # new to this server
    first = run_request(server.grpc_url, prompt=prompt, height=32, width=32, num_inference_steps=2, seed=1)
    second = run_request(server.grpc_url, prompt=prompt, height=32, width=32, num_inference_steps=2, seed=1)
    assert not first.errors and not second.errors
    np.testing.assert_array_equal(first.final.as_numpy("image"), second.final.as_numpy("image"))
    hits = metric(before, "diffusion_prompt_cache_hits_total", **labels) + 1
    assert wait_for_metric(server.metrics_url, "diffusion_prompt_cache_hits_total", hits, **labels) == hits
    after = scrape(server.metrics_url)
    assert metric(after, "diffusion_prompt_cache_misses_total", **labels) >= \
        metric(before, "diffusion_prompt_cache_misses_total", **labels) + 1
    for phase in ("schedule", "prepare", "gather", "forward", "scheduler", "decode", "convert", "emit", "encode",
                  "send"):
        assert metric(after, "diffusion_engine_phase_seconds_total", phase=phase, **labels) > \
            metric(before, "diffusion_engine_phase_seconds_total", phase=phase, **labels), phase
