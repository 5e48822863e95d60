"""LTX-2 requests on the tiny pipeline: the settings that turn every guidance pass off, a run of requests
through the engine (step mode or one request-mode wave), and image-to-video inputs (random images of other sizes
than the request's)."""

from __future__ import annotations

from functools import partial

import numpy as np

from engine_lib.engine import DiffusionEngine
from tests.helpers.hostile_images import random_png
from tests.helpers.parity_checks import PROMPTS, TEST_CONFIG, Arrival, parse, run_steps

NO_GUIDANCE = dict(guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0, audio_stg_scale=0.0,
                   modality_scale=1.0, audio_modality_scale=1.0)

def run(adapter, requests: dict, capacity=4, step_mode=True, float_outputs=True):
    """request id -> (tick, inputs); every request's float outputs (step mode: joining at its tick; else one
    request-mode wave)."""
    if not step_mode:
        finals = DiffusionEngine.wave(adapter, TEST_CONFIG, len(requests), float_outputs=float_outputs).generate(
            {rid: parse(adapter, inputs) for rid, (_, inputs) in requests.items()})
        assert all(final.ok for final in finals.values()), finals
        return {rid: final.outputs for rid, final in finals.items()}
    arrivals = [Arrival(tick, rid, inputs) for rid, (tick, inputs) in requests.items()]
    return run_steps(adapter, arrivals, capacity, float_output=float_outputs).outputs


RNG = np.random.default_rng(11)
png = partial(random_png, RNG)  # random images of other sizes than the requests'


IMAGES = [png(48, 40), png(64, 64), png(40, 56)]


def params(image: int = 0, prompt: str = PROMPTS[0], seed: int = 3, steps: int = 2, **kw) -> dict:
    return {"prompt": prompt, "num_inference_steps": steps, "seed": seed, "height": 32, "width": 32,
            "image": IMAGES[image], **kw}


def text_only(inputs: dict) -> dict:
    return {k: v for k, v in inputs.items() if k != "image"}
