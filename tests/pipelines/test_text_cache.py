"""The prompt-embedding cache: bounded in bytes, least recently used first, copies out, and through an adapter
a hit gives the image a fresh encode gives (bitwise)."""

from __future__ import annotations

import numpy as np
import torch

from engine_lib.pipelines import registry
from engine_lib.pipelines.base import move_tensors
from engine_lib.pipelines.text_cache import TextEmbeddingCache
from tests.helpers.parity_checks import load_tiny_adapter, parse, pipe_reference, solo_steps, with_cfg_batching


def text(value: float, tokens: int = 4) -> dict:
    return {"cond": {"embeds": torch.full((1, tokens, 8), value), "mask": None}}  # 4 bytes x 8 x tokens


def test_hits_misses_and_the_byte_bound():
    cache = TextEmbeddingCache(max_bytes=2 * 128)  # room for two entries of 128 bytes
    calls = []

    def encode(value):
        return lambda: calls.append(value) or text(value)

    assert cache.get_or_encode("a", encode(1.0))["cond"]["embeds"][0, 0, 0] == 1.0
    cache.get_or_encode("b", encode(2.0))
    assert cache.get_or_encode("a", encode(9.0))["cond"]["embeds"][0, 0, 0] == 1.0  # hit; "a" most recent
    cache.get_or_encode("c", encode(3.0))  # evicts "b", the least recently used
    assert (cache.hits, cache.misses, len(cache), cache.num_bytes) == (1, 3, 2, 256)
    cache.get_or_encode("b", encode(2.5))
    assert calls == [1.0, 2.0, 3.0, 2.5]
    big = cache.get_or_encode("big", lambda: text(4.0, tokens=100))  # larger than the cache: served, not kept
    assert big["cond"]["embeds"].shape[1] == 100 and "big" not in cache._entries
    off = TextEmbeddingCache(0)
    off.get_or_encode("a", encode(1.0))
    off.get_or_encode("a", encode(1.0))
    assert (off.hits, off.misses, len(off)) == (0, 2, 0)


def test_what_a_state_does_to_its_copy_never_reaches_the_cache():
    cache = TextEmbeddingCache(1 << 20)
    first = cache.get_or_encode("a", lambda: text(1.0))
    move_tensors(first, torch.device("meta"))  # a paused request moves its tensors
    first["cond"]["extra"] = torch.zeros(1)
    again = cache.get_or_encode("a", lambda: text(2.0))
    assert again["cond"]["embeds"].device.type == "cpu" and "extra" not in again["cond"]


def test_a_repeated_prompt_is_a_hit_and_the_same_image():
    adapter = load_tiny_adapter("qwen_image", registry.get_adapter_class("qwen_image"))
    inputs = {"prompt": "a repeated prompt for the cache", "num_inference_steps": 3, "seed": 2, "height": 32,
              "width": 32, "max_sequence_length": 64}
    hits, misses = adapter.text_cache.hits, adapter.text_cache.misses
    first = solo_steps(adapter, parse(adapter, inputs), float_output=True)
    second = solo_steps(adapter, parse(adapter, {**inputs, "seed": 2}), float_output=True)
    assert (adapter.text_cache.hits, adapter.text_cache.misses) == (hits + 1, misses + 1)
    np.testing.assert_array_equal(first, second)
    np.testing.assert_array_equal(second, pipe_reference(adapter)(inputs))  # a hit is still diffusers' own image
    cfg = {**inputs, "negative_prompt": "blurry", "true_cfg_scale": 4.0}
    solo_steps(adapter, parse(adapter, cfg))
    other = solo_steps(adapter, parse(adapter, {**cfg, "negative_prompt": "dark"}), float_output=True)
    assert adapter.text_cache.misses == misses + 3  # CFG, and CFG on another negative prompt, are other entries
    fresh = with_cfg_batching(adapter, True)  # the same pipe, an empty cache
    np.testing.assert_array_equal(other, solo_steps(fresh, parse(fresh, {**cfg, "negative_prompt": "dark"}),
                                                    float_output=True))
    counters = adapter.counters()
    assert (counters["prompt_cache_hits"], counters["prompt_cache_misses"]) == (adapter.text_cache.hits,
                                                                               adapter.text_cache.misses)
