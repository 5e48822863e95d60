"""Several model instances through a real tritonserver: `instance_group [{ count: 2, kind: KIND_CPU }]`
gives two engines (one per Python stub) that share the load, each on the device its kind names,
each with its own metric series; the server unloads them cleanly. (KIND_GPU's mapping to cuda:N is
unit-tested in tests/test_config.py: it needs GPUs to load.)"""

from __future__ import annotations

import re

from tests.helpers.servers import module_server
from tests.helpers.streaming import RequestStream, close_all, metric, scrape, wait_for_metric

INSTANCES = ("qwen_image_0_0", "qwen_image_0_1")


two_instances = module_server("instances", instance_group="instance_group [ { count: 2, kind: KIND_CPU } ]",
                              step_execution="true", max_num_seqs="1")


def test_each_instance_loads_its_own_engine_on_the_cpu(two_instances):
    loaded = re.findall(r"qwen_image: loaded pipeline=qwen_image instance=(\S+) .*? device=(\S+)",
                        two_instances.log_text())
    assert sorted(loaded) == [(name, "cpu") for name in INSTANCES]


def test_two_engines_share_the_load(two_instances):
    budget = two_instances.budget.hold()
    streams = []
    try:
        streams = [RequestStream(two_instances.grpc_url).send(f"r{i}", prompt=f"p{i}", num_inference_steps=2)
                   for i in range(8)]
        assert wait_for_metric(two_instances.metrics_url, "diffusion_requests_waiting", 8.0, model="qwen_image") == 8
        waiting = scrape(two_instances.metrics_url)
        per_instance = [metric(waiting, "diffusion_requests_waiting", instance=name) for name in INSTANCES]
        assert min(per_instance) >= 1, per_instance  # Triton handed requests to both instances
        budget.release()
        for stream in streams:
            result = stream.collect()
            assert not result.errors and result.num_final == 1, result.errors
    finally:
        close_all(streams, budget)
    done = scrape(two_instances.metrics_url)
    per_instance = [metric(done, "diffusion_requests_total", instance=name, outcome="success") for name in INSTANCES]
    assert sum(per_instance) == 8 and min(per_instance) >= 1, per_instance


def test_the_server_unloads_both_instances_and_exits_cleanly(two_instances):
    """Two instances once shared metric series; Triton's core then freed them twice at unload (abort)."""
    code = two_instances.stop()
    assert code == 0, two_instances.log_tail()
    assert two_instances.log_text().count("qwen_image: stopped") == 2
