"""A flow-matching adapter's request cost (what `max_batch_tokens` counts) and the admissions it gives: a
request with classifier-free guidance runs two rows per image, so it costs twice its tokens (no model: the
cost reads only the VAE's scale factor)."""

from __future__ import annotations

from types import SimpleNamespace

from engine_lib.config import SchedulerConfig
from engine_lib.pipelines.flow_match import FlowMatchAdapter
from engine_lib.request import DiffusionRequest, SamplingParams
from engine_lib.sched import RunnerOutput, Scheduler, step_batch_key


def adapter(cfg_kind: str) -> FlowMatchAdapter:
    """A flow-matching adapter without a model: size multiple 16 (a VAE scale factor of 8, then 2x2 packing)."""
    cls = type(f"Costs_{cfg_kind}", (FlowMatchAdapter,), {"cfg_kind": cfg_kind, "__abstractmethods__": frozenset()})
    instance = object.__new__(cls)
    instance.pipe = SimpleNamespace(vae_scale_factor=8)
    return instance


def params(height=16, width=16, num_images=1, **guidance) -> SamplingParams:
    return SamplingParams({"prompt": "p", "height": height, "width": width, "num_images": num_images,
                           "num_inference_steps": 3, **guidance})


def test_cfg_doubles_the_cost_of_every_image():
    sd3_like, qwen_like = adapter("cfg"), adapter("true_cfg")
    assert sd3_like.request_cost(params(48, 16, guidance_scale=1.0)) == 3  # 3 x 1 tokens, one row
    assert sd3_like.request_cost(params(16, 16, guidance_scale=5.0)) == 2  # 1 token, cond + uncond
    assert sd3_like.request_cost(params(32, 16, num_images=3, guidance_scale=5.0)) == 12
    assert qwen_like.request_cost(params(16, 16, negative_prompt=None, true_cfg_scale=4.0)) == 1
    assert qwen_like.request_cost(params(16, 16, negative_prompt="blur", true_cfg_scale=4.0)) == 2
    assert qwen_like.request_cost(params(16, 16, negative_prompt="blur", true_cfg_scale=1.0)) == 1


def test_the_budget_admits_by_the_adapters_cost_with_its_cfg_rows():
    costs = adapter("cfg")
    sched = Scheduler(SchedulerConfig(step_execution=True, max_num_seqs=8, max_batch_tokens=7, max_preemptions=0),
                      lambda p: step_batch_key(p, ()), cost_fn=costs.request_cost, max_head_bypass=0)
    for rid, p in (("plain-3", params(48, 16, guidance_scale=1.0)), ("cfg-2", params(16, 16, guidance_scale=5.0)),
                   ("cfg-4", params(32, 16, guidance_scale=5.0)), ("plain-1", params(16, 16, guidance_scale=1.0))):
        sched.add_request(DiffusionRequest(rid, p))
    out = sched.schedule()
    assert out.new_ids == ["plain-3", "cfg-2"]  # 3 + 2; "cfg-4" makes 9 (as one row per image, 7: it would join)
    sched.update_from_output(out, RunnerOutput(step_index={rid: 1 for rid in out.scheduled_ids}))
    assert sched.num_running == 2 and sched.num_waiting == 2
