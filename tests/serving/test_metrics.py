"""Custom metrics on Triton's /metrics port move with traffic."""

from __future__ import annotations

from .streaming import metric, run_request, scrape, wait_for_metric

LABELS = {"model": "qwen_image"}


def test_counters_and_histograms_move(server):
    before = scrape(server.metrics_url)
    ok = run_request(server.grpc_url, prompt="metrics", height=32, width=32, num_inference_steps=2)
    bad = run_request(server.grpc_url, prompt="metrics", height=33)
    assert ok.num_final == 1 and not ok.errors and bad.errors

    for outcome in ("success", "rejected"):
        expected = metric(before, "diffusion_requests_total", outcome=outcome, **LABELS) + 1
        assert wait_for_metric(server.metrics_url, "diffusion_requests_total", expected, outcome=outcome,
                               **LABELS) == expected, outcome
    after = scrape(server.metrics_url)
    for histogram in ("diffusion_batch_size", "diffusion_tick_seconds", "diffusion_time_to_first_response_seconds",
                      "diffusion_request_latency_seconds"):
        assert metric(after, f"{histogram}_count", **LABELS) > metric(before, f"{histogram}_count", **LABELS), histogram
        assert metric(after, f"{histogram}_sum", **LABELS) > metric(before, f"{histogram}_sum", **LABELS), histogram
    for gauge in ("diffusion_requests_waiting", "diffusion_requests_running", "diffusion_runner_states",
                  "diffusion_open_streams"):
        assert ("{}".format(gauge), frozenset(LABELS.items())) in after, gauge
    # Triton's own per-model counters count the request too.
    assert metric(after, "nv_inference_request_success", model="qwen_image", version="1") > 0
