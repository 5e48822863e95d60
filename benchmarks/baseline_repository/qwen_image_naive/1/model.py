"""The naive baseline: one `pipe(...)` call per request, as Triton diffusion tutorials do.

Deliberately simple and standalone (only diffusers and torch): it is what the engine is compared against. The dynamic
batcher hands execute() up to max_batch_size requests; each one is generated in turn and all responses are returned
together at the end.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from diffusers import DiffusionPipeline

DEFAULTS = {"height": 64, "width": 64, "num_inference_steps": 4, "seed": 0}


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"]).get("parameters", {}).items()}
        model_path = params.get("model_path") or os.environ.get("DIFFUSION_MODEL_PATH", "")
        if not model_path:
            raise pb_utils.TritonModelException("parameter 'model_path' is empty and $DIFFUSION_MODEL_PATH is unset")
        device = params.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.device = device
        self.pipe = DiffusionPipeline.from_pretrained(model_path, dtype=dtype).to(device)
        self.pipe.set_progress_bar_config(disable=True)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                image = self._generate(request)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("image", image)]))
            except Exception as exc:  # noqa: BLE001 - one bad request must not fail the batch
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
        return responses

    def _generate(self, request) -> np.ndarray:
        prompt = pb_utils.get_input_tensor_by_name(request, "prompt").as_numpy().reshape(-1)[0].decode("utf-8")
        values = dict(DEFAULTS)
        for name in values:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                values[name] = int(tensor.as_numpy().reshape(-1)[0])
        generator = torch.Generator(device=self.device).manual_seed(values.pop("seed"))
        with torch.inference_mode():
            images = self.pipe(prompt=prompt, generator=generator, output_type="np", **values).images
        return (images * 255).round().astype(np.uint8)  # [1, H, W, 3]: the batch dim is this request's
