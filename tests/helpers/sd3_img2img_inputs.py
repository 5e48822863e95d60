"""SD3 image-to-image requests on the tiny pipeline: three random images of other sizes than the request's and
the request's inputs (shared by the img2img and inpaint tests)."""

from __future__ import annotations

from functools import partial

import numpy as np

from tests.helpers.hostile_images import random_png
from tests.helpers.parity_checks import PROMPTS

RNG = np.random.default_rng(7)
png = partial(random_png, RNG)  # random images of other sizes than the requests'


IMAGES = [png(48, 40), png(80, 64), png(64, 64)]


def params(image: int = 0, strength: float = 0.6, prompt: str = PROMPTS[0], seed: int = 3, steps: int = 5,
           **kw) -> dict:
    return {"prompt": prompt, "num_inference_steps": steps, "seed": seed, "height": 64, "width": 64,
            "max_sequence_length": 32, "guidance_scale": 1.0, "image": IMAGES[image], "strength": strength, **kw}
