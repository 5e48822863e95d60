"""Requests that finish denoising in nearby ticks decode in one VAE call (the scheduler's decode groups), and
their images are the ones they get decoded alone (within the batched tolerance)."""

from __future__ import annotations

from engine_lib.interface import to_uint8
from engine_lib.pipelines import registry
from engine_lib.sched import scheduler
from tests.helpers.parity_checks import Arrival, assert_close_images, load_tiny_adapter, run_steps

STAGGERED = [Arrival(tick, f"r{tick}", {"prompt": f"a photo {tick}", "num_inference_steps": 3, "seed": tick,
                                        "height": 32, "width": 32}) for tick in range(3)]


def decode_calls(adapter, **kw):
    calls = []
    post_decode = adapter.post_decode
    adapter.post_decode = lambda states: calls.append([s.request_id for s in states]) or post_decode(states)
    try:
        result = run_steps(adapter, STAGGERED, float_output=True, **kw)
    finally:
        del adapter.post_decode
    return calls, result


def test_requests_finishing_a_tick_apart_decode_together_and_keep_their_images():
    adapter = load_tiny_adapter("qwen_image", registry.get_adapter_class("qwen_image"))
    alone, separate = decode_calls(adapter, group_decodes=False)
    grouped, together = decode_calls(adapter, group_decodes=True)  # a decode waits at most 2 ticks
    assert alone == [["r0"], ["r1"], ["r2"]]
    assert grouped == [["r0", "r1", "r2"]]  # r0 waits two ticks, r1 one, for r2
    assert together.finished_at == {"r0": 4, "r1": 4, "r2": 4} and separate.finished_at == {"r0": 2, "r1": 3, "r2": 4}
    assert max(together.batch_sizes) == 3 and together.batch_sizes[-1] == 3  # the waiting ones stay running
    for rid, image in together.images.items():
        assert_close_images(image, separate.images[rid], to_uint8)


def test_a_request_waits_at_most_the_decode_hold(monkeypatch):
    monkeypatch.setattr(scheduler, "DECODE_HOLD_TICKS", 1)
    adapter = load_tiny_adapter("qwen_image", registry.get_adapter_class("qwen_image"))
    grouped, result = decode_calls(adapter, group_decodes=True)
    assert grouped == [["r0", "r1"], ["r2"]]  # r0 waited one tick for r1; r2 was two ticks away from r0
    assert result.finished_at == {"r0": 3, "r1": 3, "r2": 4}
