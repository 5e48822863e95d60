"""The front door's only way to the models: tritonclient's asyncio gRPC client.

One bidirectional stream per request (the engine's responses for one request arrive
on it in step order); leaving `stream()` early cancels the request on the server.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping, NamedTuple, Optional

import grpc
import numpy as np

from engine_lib.config import SchedulerConfig
from engine_lib.interface import INT_RANGES, VIDEO_FRAME_RATES
from engine_lib.request import InvalidInputError
from engine_lib.serving.openai_api.requests import OpenAIError
from engine_lib.serving.tensors import NUMPY_DTYPES

DEFAULT_PRIORITY_LEVEL = SchedulerConfig.default_priority_level  # a model without the parameter has the engine's


@dataclass
class Response:
    """One response of a streamed request: progress, maybe images (uint8 [N, H, W, 3]), final or not."""

    step: int
    num_steps: int
    is_final: bool
    images: Optional[np.ndarray]
    outputs: dict[str, np.ndarray] = field(default_factory=dict)  # every output tensor of the response
    model_version: str = ""


class TritonRequestError(Exception):
    """The request ended with an error (Triton's message, which starts with its code)."""


def triton_datatype(triton_type: str) -> str:
    """A model config's `TYPE_INT32` as the request datatype `INT32` (`TYPE_STRING`: `BYTES`)."""
    return "BYTES" if triton_type == "TYPE_STRING" else triton_type.removeprefix("TYPE_")


class InputType(NamedTuple):
    """One declared input of a model's config: its Triton type and its element count (dims [count]; -1: any)."""

    triton_type: str  # TYPE_INT32, TYPE_STRING, ...
    count: int = 1


def to_tensor(name: str, value: Any, input_type: InputType) -> np.ndarray:
    """A JSON value as the [count] array of the input's datatype; a value of the wrong kind (a float or a
    string for an integer, an integer past the datatype's range, a list for a [1] input, a list of another
    length for a [count] one) raises InvalidInputError naming it."""
    if input_type.count == -1:  # a variable count (several images): one value or a list; the model bounds it
        value = value if isinstance(value, list) else [value]
        if not value:
            raise InvalidInputError(name, "must hold one or more values, got an empty list")
    elif input_type.count > 1 and (not isinstance(value, list) or len(value) != input_type.count):
        raise InvalidInputError(name, f"must be a list of {input_type.count} values, got {_short(value)}")
    if input_type.count != 1:
        return np.concatenate([to_tensor(name, item, InputType(input_type.triton_type)) for item in value])
    triton_type = input_type.triton_type
    datatype = triton_datatype(triton_type)
    dtype = NUMPY_DTYPES[datatype][0]
    if isinstance(value, (list, dict)):
        raise InvalidInputError(name, f"must be one JSON value, not {type(value).__name__} {_short(value)}")
    if datatype == "BYTES":
        if isinstance(value, bytes):  # a file of a form (an edit's image), as it came
            return np.array([value], dtype=dtype)
        if not isinstance(value, str):
            raise InvalidInputError(name, f"must be a string, got {_short(value)}")
        return np.array([value.encode("utf-8")], dtype=dtype)
    if datatype == "BOOL":
        if not isinstance(value, bool):
            raise InvalidInputError(name, f"must be true or false, got {_short(value)}")
        return np.array([value], dtype=dtype)
    if datatype in INT_RANGES:
        low, high = INT_RANGES[datatype]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise InvalidInputError(name, f"must be an integer in [{low}, {high}], got {_short(value)}")
        return np.array([value], dtype=dtype)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite_as(value, dtype):
        raise InvalidInputError(name, f"must be a finite number within {datatype}'s range, got {_short(value)}")
    return np.array([value], dtype=dtype)


def _finite_as(value: float, dtype: Any) -> bool:
    """The number stays finite as `dtype` (1e300 is inf as FP32; JSON's 10**400 is not even a float)."""
    try:
        return math.isfinite(value) and abs(float(value)) <= np.finfo(dtype).max
    except OverflowError:
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


class TritonGateway:
    """Ready models, their declared inputs, and streamed requests, over tritonclient.grpc.aio."""

    def __init__(self, url: str, admin_key: Optional[str] = None):
        import tritonclient.grpc.aio as grpcclient

        self._grpc = grpcclient
        self.url = url
        self.client = grpcclient.InferenceServerClient(url)
        self._configs: dict[str, tuple[dict[str, InputType], set[str], Optional[int], Optional[float]]] = {}
        # The launcher protects Triton's repository API (which lists the models) with a key.
        key = os.environ.get("TRITON_ADMIN_KEY", "") if admin_key is None else admin_key
        self._index_headers = {"triton-grpc-protocol-admin-key": key} if key else None

    async def close(self) -> None:
        await self.client.close()

    async def server_ready(self) -> bool:
        try:
            return bool(await self.client.is_server_ready())
        except Exception:  # noqa: BLE001 - unreachable is not ready
            return False

    async def ready_models(self, output: str = "image") -> list[str]:
        """The ready models with the declared `output`: `image` for the Images API (video models are not its),
        `video_mp4` for the video jobs."""
        index = await self.client.get_model_repository_index(headers=self._index_headers, as_json=True)
        ready = sorted(m["name"] for m in index.get("models", []) if m.get("state") == "READY")
        return [name for name in ready if output in (await self._config(name))[1]]

    async def input_types(self, model: str) -> dict[str, InputType]:
        """The model's declared inputs (name -> type and count), from its config; cached per model."""
        return (await self._config(model))[0]

    async def default_priority(self, model: str) -> Optional[int]:
        """The model's `default_priority_level` parameter (the engine's default without one; None: unreadable)."""
        return (await self._config(model))[2]

    async def video_frame_rate(self, model: str) -> Optional[float]:
        """The frames per second of the model's videos when a request sets none: its `default_frame_rate`
        parameter, else its pipeline's (interface.VIDEO_FRAME_RATES); None: no video pipeline known here."""
        return (await self._config(model))[3]

    async def _config(self, model: str) -> tuple[dict[str, InputType], set[str], Optional[int], Optional[float]]:
        """(inputs by name, output names, default priority level, video frame rate) of the model's config, cached
        per model."""
        if model not in self._configs:
            config = (await self.client.get_model_config(model, as_json=True))["config"]
            inputs = {i["name"]: InputType(i["data_type"], int(i.get("dims", [1])[0])) for i in config.get("input", [])}
            parameters = {key: value.get("string_value") for key, value in config.get("parameters", {}).items()}
            level = parameters.get("default_priority_level")
            default = DEFAULT_PRIORITY_LEVEL if level is None else int(level) if level.strip().isdecimal() else None
            rate = parameters.get("default_frame_rate") or ""
            frame_rate = (float(rate) if re.fullmatch(r"\s*\d+(\.\d*)?\s*", rate) else
                          VIDEO_FRAME_RATES.get(parameters.get("pipeline") or ""))
            self._configs[model] = (inputs, {o["name"] for o in config.get("output", [])}, default, frame_rate)
        return self._configs[model]

    def tensors(self, inputs: Mapping[str, Any], input_types: Mapping[str, InputType]) -> list:
        """JSON values as the request's input tensors; raises InvalidInputError naming a bad one."""
        tensors = []
        for name, value in inputs.items():
            array = to_tensor(name, value, input_types[name])
            tensor = self._grpc.InferInput(name, list(array.shape), triton_datatype(input_types[name].triton_type))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        return tensors

    async def stream(self, model: str, tensors: list, request_id: str,
                     parameters: Optional[Mapping[str, str]] = None) -> AsyncIterator[Response]:
        """Send one request (with request `parameters`, e.g. `priority_key`) and yield its responses up to the
        final one; raises TritonRequestError.

        Leaving the iteration before the final response (the HTTP client went away, or
        an error here) cancels the request on the server.
        """
        finished = asyncio.Event()

        async def requests():
            yield {"model_name": model, "inputs": tensors, "request_id": request_id,
                   "enable_empty_final_response": True, "parameters": dict(parameters or {}) or None}
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
        except grpc.RpcError as exc:  # the stream broke: tritonserver died or went away
            finished.set()
            raise TritonRequestError(f"{exc.code().name}: {exc.details()}") from None
        finally:
            if not finished.is_set():
                finished.set()
                call.cancel()


def _response(result) -> Response:
    response = result.get_response()
    is_final = "triton_final_response" in response.parameters and response.parameters["triton_final_response"].bool_param
    outputs = {output.name: result.as_numpy(output.name) for output in response.outputs}
    step, num_steps = outputs.get("step"), outputs.get("num_steps")
    return Response(step=int(step[0]) if step is not None else 0,
                    num_steps=int(num_steps[0]) if num_steps is not None else 0,
                    is_final=is_final, images=outputs.get("image"), outputs=outputs,
                    model_version=response.model_version)


__all__ = ["OpenAIError", "Response", "TritonGateway", "TritonRequestError", "to_tensor"]
