"""`scheduling_policy=deadline` through a real tritonserver: requests carry Triton's request timeout
(tritonclient's `timeout=`), the engine measures its ticks, and a request that can still finish by its
deadline goes before an older one with an earlier deadline that it could no longer make. Order-based and
held by the tick budget; the one margin is the estimate: the hopeless request's work at the measured rate
is many times its deadline."""

from __future__ import annotations

from tests.helpers.servers import module_server
from tests.helpers.streaming import RequestStream, close_all, run_request, wait_for_metric

LABELS = dict(model="qwen_image")


deadline_server = module_server("deadlines", step_execution="true", max_num_seqs="1", max_preemptions="0",
                                scheduling_policy="deadline", max_num_inference_steps="1000")


def test_a_request_that_can_make_its_deadline_goes_before_one_that_cannot(deadline_server):
    url = deadline_server.grpc_url
    # the engine learns its seconds per step from real ticks (64x64: 64 latent tokens a step)
    assert not run_request(url, request_id="measure", prompt="measure", num_inference_steps=4).errors
    budget = deadline_server.budget.hold()
    streams = []
    try:
        # 1000 steps of 4096 tokens: at the measured rate far more than its 10 s, which it could only make
        # on a machine over 50x faster per token than the one it measured
        hopeless = RequestStream(url).send("hopeless", prompt="big", height=512, width=512,
                                           num_inference_steps=1000, timeout_us=10_000_000)
        streams.append(hopeless)
        assert wait_for_metric(deadline_server.metrics_url, "diffusion_requests_waiting", 1.0, **LABELS) == 1
        feasible = RequestStream(url).send("feasible", prompt="small", num_inference_steps=2,
                                           timeout_us=600_000_000)
        streams.append(feasible)
        assert wait_for_metric(deadline_server.metrics_url, "diffusion_requests_waiting", 2.0, **LABELS) == 2
        budget.release()
        done = feasible.collect(timeout=20)
        assert not done.errors and done.num_final == 1
        # earliest deadline first would have run "hopeless" (its deadline is earlier) for minutes first
        assert hopeless.final_at is None
    finally:
        for stream in streams:
            stream.cancel()
        close_all(streams, budget)
