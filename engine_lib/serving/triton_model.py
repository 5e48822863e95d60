"""The Triton Python-backend model class shared by every pipeline's model.py.

Lifecycle, in start order (finalize stops in reverse):
1. parse `parameters` into EngineConfig (a bad value fails the load, naming it),
2. load the pipeline adapter once, make the engine (mode checks, warm-up),
3. start the metrics thread and the sender thread.

`execute()` never waits for generation: it validates each request (its inputs,
which arrive only as tensors; its parameters, of which only `priority_key` is read
(serving/parameters.py); and whether it may ask for its priority), where a bad one
gets its INVALID_ARG FINAL at once and never reaches the engine, opens the
request's stream on the sender, admits it into the engine and returns None.
Fixed log lines mark each lifecycle event: "<model>: loaded ...",
"<model>: cancelled request ...", "<model>: shutting down", "<model>: stopped".
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import sys
import time

import triton_python_backend_utils as pb_utils

from engine_lib.config import ConfigError, EngineConfig
from engine_lib.placement import for_instance
from engine_lib.serving.metrics import ModelMetrics
from engine_lib.serving.parameters import PRIORITY_KEY, PRIORITY_KEY_ENVIRONMENT, check_priority, read_parameters
from engine_lib.serving.sender import OpenStream, ResponseSender, echoed_id
from engine_lib.serving.tensors import read_inputs


def _log(line: str) -> None:
    pb_utils.Logger.log_info(line)


class _TritonLogHandler(logging.Handler):
    """Sends engine_lib's `logging` records to Triton's log (the stub has no console of its own)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = f"{record.name}: {record.getMessage()}"
            if record.levelno >= logging.ERROR:
                if record.exc_info:
                    line += "\n" + logging.Formatter().formatException(record.exc_info)
                pb_utils.Logger.log_error(line)
            elif record.levelno >= logging.WARNING:
                pb_utils.Logger.log_warn(line)
            else:
                pb_utils.Logger.log_info(line)
        except Exception:  # noqa: BLE001 - logging must never raise into the engine
            pass


def _install_log_handler() -> None:
    root = logging.getLogger("engine_lib")
    if not any(isinstance(h, _TritonLogHandler) for h in root.handlers):
        root.addHandler(_TritonLogHandler())
    root.setLevel(logging.INFO)


class TritonPythonModel:
    """Decoupled model: validates and admits requests; the engine and the sender thread do the rest."""

    def initialize(self, args: dict) -> None:
        start = time.monotonic()
        _install_log_handler()
        self.model_name = args["model_name"]
        self.instance_name = args.get("model_instance_name", self.model_name)
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException(
                f"{self.model_name}: config.pbtxt must set model_transaction_policy {{ decoupled: true }}")
        try:
            self.config = for_instance(EngineConfig.from_parameters(model_config.get("parameters", {})),
                                       args.get("model_instance_kind", ""), args.get("model_instance_device_id", "0"))
        except ConfigError as exc:
            raise pb_utils.TritonModelException(f"{self.model_name}: {exc}") from None

        # Heavy (torch + diffusers): imported once the configuration is known to be valid.
        from engine_lib.engine import DiffusionEngine  # noqa: PLC0415
        from engine_lib.pipelines import levers  # noqa: PLC0415
        from engine_lib.pipelines.registry import resolve_model_path  # noqa: PLC0415
        from engine_lib.hooks import hooks_from_environment  # noqa: PLC0415

        self.metrics = ModelMetrics(pb_utils, self.model_name, log=_log, instance=self.instance_name,
                                    priority_levels=self.config.scheduler.priority_levels)
        try:
            self.engine = DiffusionEngine.make_engine(self.config, tick_listener=self.metrics.tick,
                                                      hooks=hooks_from_environment(self.model_name))
            self.adapter = self.engine.adapter
        except ConfigError as exc:
            raise pb_utils.TritonModelException(f"{self.model_name}: {exc}") from None
        loaded_levers = levers.describe(self.adapter)
        self.metrics.weight_bytes(levers.weight_bytes(self.adapter.pipe))
        self.sender = ResponseSender(pb_utils, self.engine.abort, self.metrics, _log, self.model_name,
                                     outputs={spec.name: spec for spec in self.adapter.outputs},
                                     clock=self.engine.clock)
        self.metrics.start(self.engine.stats)
        self.sender.start()
        self._ids = itertools.count(1)
        self._priority_key = os.environ.get(PRIORITY_KEY_ENVIRONMENT, "")  # empty: nobody passes the default level
        c = self.config
        _log(f"{self.model_name}: loaded pipeline={c.model.pipeline} instance={self.instance_name} "
             f"model_path={resolve_model_path(self.config)} "
             f"device={self.adapter.device} dtype={self.adapter.dtype} mode={self.engine.mode.value} "
             f"step_execution={c.scheduler.step_execution} max_num_seqs={c.scheduler.max_num_seqs} "
             f"max_queue={c.limits.max_queue} "
             f"in {time.monotonic() - start:.1f} s; {loaded_levers}")

    def execute(self, requests: list) -> None:
        """Admit each request and return at once; every request ends with exactly one FINAL response."""
        for request in requests:
            try:
                response_sender = request.get_response_sender()
            except Exception as exc:  # noqa: BLE001 - nothing can be sent without a sender
                _log(f"{self.model_name}: request without a response sender: {exc!r}")
                continue
            client_id = ""
            try:
                client_id = request.request_id() or ""
                control = read_parameters(request.parameters(), self.engine.inputs)
                params = self.engine.parse(read_inputs(self._input_arrays(request), self.engine.inputs.specs))
                check_priority(params.get("priority") or 0, self.config.scheduler.default_priority_level,
                               self.config.scheduler.priority_levels, control.get(PRIORITY_KEY), self._priority_key)
            except Exception as exc:  # noqa: BLE001 - bad input (or a bug): answer now, queue nothing
                self.sender.reject(response_sender, exc, client_id)
                continue
            request_id = f"{echoed_id(client_id) or 'request'}#{next(self._ids)}"  # unique even if clients reuse ids
            self.sender.open(OpenStream(request_id, client_id, response_sender,
                                        params.output_format, time.monotonic()))
            try:
                self.engine.add_request(request_id, params, sink=self.sender.enqueue, timeout_s=_timeout_s(request))
            except Exception as exc:  # noqa: BLE001 - queue full, shutting down, adapter check, ...
                self.sender.fail(request_id, exc)
        return None

    def _input_arrays(self, request) -> dict:
        """The declared inputs the request sent (config.pbtxt lists exactly these, so Triton refuses others)."""
        inputs = {}
        for name in self.engine.inputs.specs:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        return inputs

    def finalize(self) -> None:
        """Close the engine (open streams end UNAVAILABLE), drain the sender, stop metrics."""
        _log(f"{self.model_name}: shutting down")
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close(timeout=5.0)
        sender = getattr(self, "sender", None)
        if sender is not None:
            sender.close(timeout_s=3.0)
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.close()
        _log(f"{self.model_name}: stopped")
        atexit.register(_exit_without_teardown)


def _timeout_s(request) -> "float | None":
    """Triton's request timeout (tritonclient's `timeout=`, microseconds; 0: none) in seconds."""
    timeout_us = request.timeout() if hasattr(request, "timeout") else 0
    return timeout_us / 1e6 if timeout_us else None


def _exit_without_teardown() -> None:
    """Registered by finalize(): end the stub process at interpreter exit without tearing down
    torch/diffusers modules. That teardown takes seconds on a CPU machine, longer than the rest
    of a server stop, and nothing is left to clean up once finalize() has returned and the stub
    has answered tritonserver."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(0)
