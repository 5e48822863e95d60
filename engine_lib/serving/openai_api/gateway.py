"""The front door's only way to the models: tritonclient's asyncio gRPC client.

One bidirectional stream per request (the engine's responses for one request arrive
on it in step order); leaving `stream()` early cancels the request on the server.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Mapping, Optional

import numpy as np

from engine_lib.interface import INT_RANGES
from engine_lib.serving.openai_api.requests import OpenAIError, bad_request, openai_param
from engine_lib.serving.tensors import NUMPY_DTYPES


@dataclass
class Response:
    """One response of a streamed request: progress, maybe images (uint8 [N, H, W, 3]), final or not."""

    step: int
    num_steps: int
    is_final: bool
    images: Optional[np.ndarray]


class TritonRequestError(Exception):
    """The request ended with an error (Triton's message, which starts with its code)."""


def triton_datatype(triton_type: str) -> str:
    """A model config's `TYPE_INT32` as the request datatype `INT32` (`TYPE_STRING`: `BYTES`)."""
    return "BYTES" if triton_type == "TYPE_STRING" else triton_type.removeprefix("TYPE_")


def to_tensor(name: str, value: Any, triton_type: str) -> np.ndarray:
    """A JSON value as the [1] array of the input's datatype; a value of the wrong kind is refused naming it."""
    datatype = triton_datatype(triton_type)
    dtype = NUMPY_DTYPES[datatype][0]
    param = openai_param(name)
    if datatype == "BYTES":
        if not isinstance(value, str):
            raise bad_request(f"{param} must be a string", param)
        return np.array([value.encode("utf-8")], dtype=dtype)
    if datatype in INT_RANGES:
        low, high = INT_RANGES[datatype]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise bad_request(f"{param} must be an integer in [{low}, {high}]", param)
        return np.array([value], dtype=dtype)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{param} must be a number", param)
    return np.array([value], dtype=dtype)


class TritonGateway:
    """Ready models, their declared inputs, and streamed requests, over tritonclient.grpc.aio."""

    def __init__(self, url: str):
        import tritonclient.grpc.aio as grpcclient

        self._grpc = grpcclient
        self.url = url
        self.client = grpcclient.InferenceServerClient(url)
        self._input_types: dict[str, dict[str, str]] = {}

    async def close(self) -> None:
        await self.client.close()

    async def server_ready(self) -> bool:
        try:
            return bool(await self.client.is_server_ready())
        except Exception:  # noqa: BLE001 - unreachable is not ready
            return False

    async def ready_models(self) -> list[str]:
        index = await self.client.get_model_repository_index(as_json=True)
        return sorted(m["name"] for m in index.get("models", []) if m.get("state") == "READY")

    async def input_types(self, model: str) -> dict[str, str]:
        """The model's declared inputs (name -> Triton type), from its config; cached per model."""
        if model not in self._input_types:
            config = await self.client.get_model_config(model, as_json=True)
            self._input_types[model] = {i["name"]: i["data_type"] for i in config["config"].get("input", [])}
        return self._input_types[model]

    async def stream(self, model: str, inputs: Mapping[str, Any], input_types: Mapping[str, str],
                     request_id: str) -> AsyncIterator[Response]:
        """Send one request and yield its responses up to the final one; raises TritonRequestError.

        Leaving the iteration before the final response (the HTTP client went away, or
        an error here) cancels the request on the server.
        """
        tensors = []
        for name, value in inputs.items():
            array = to_tensor(name, value, input_types[name])
            tensor = self._grpc.InferInput(name, [1], triton_datatype(input_types[name]))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        finished = asyncio.Event()

        async def requests():
            yield {"model_name": model, "inputs": tensors, "request_id": request_id,
                   "enable_empty_final_response": True}
            await finished.wait()  # keep our side of the stream open until the final response

        call = self.client.stream_infer(requests())
        try:
            async for result, error in call:
                if error is not None:
                    finished.set()
                    raise TritonRequestError(error.message())
                response = _response(result)
                if response.is_final:
                    finished.set()
                yield response
                if response.is_final:
                    return
        finally:
            if not finished.is_set():
                finished.set()
                call.cancel()


def _response(result) -> Response:
    params = result.get_response().parameters
    is_final = "triton_final_response" in params and params["triton_final_response"].bool_param
    step, num_steps = result.as_numpy("step"), result.as_numpy("num_steps")
    return Response(step=int(step[0]) if step is not None else 0,
                    num_steps=int(num_steps[0]) if num_steps is not None else 0,
                    is_final=is_final, images=result.as_numpy("image"))


__all__ = ["OpenAIError", "Response", "TritonGateway", "TritonRequestError", "to_tensor"]
