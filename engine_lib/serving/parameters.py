"""Request parameters at the Triton edge: the one control parameter (`priority_key`), and who may jump the queue.

Parameters never stand in for inputs. Over gRPC a client could otherwise send
`prompt` as a parameter and skip the typed tensor; over HTTP generate Triton already
makes every declared input a tensor, so the parameters left there are the JSON keys
that are no input (a misspelled `"heigth"`), refused by name so that none vanishes.
Triton's own request options (tritonclient's `priority=`, `timeout=`, request id,
`enable_empty_final_response`) are taken by Triton and never reach the model; HTTP
generate's `"id"` is the request id and reaches it as a parameter too, so it is let
through (measured on 2.51, tests/serving/test_security_inputs.py).

Pure Python: testable without Triton.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from engine_lib.interface import InputSchema
from engine_lib.request import InvalidInputError

PRIORITY_KEY = "priority_key"  # the request parameter that unlocks the levels above the default
PRIORITY_KEY_ENVIRONMENT = "DIFFUSION_PRIORITY_KEY"  # the stub's environment variable that holds its value
CONTROL_PARAMETERS = (PRIORITY_KEY,)
TRITON_PARAMETERS = ("id",)  # HTTP generate's request id, which the model reads as request_id()


def read_parameters(parameters_json: str, schema: InputSchema) -> dict[str, Any]:
    """The request's control parameters; any other parameter is an InvalidInputError naming it."""
    try:
        parameters = json.loads(parameters_json or "{}")
    except ValueError:
        parameters = {}
    if not isinstance(parameters, dict):
        parameters = {}
    for name in sorted(parameters):
        if name in CONTROL_PARAMETERS or name in TRITON_PARAMETERS:
            continue
        if name in schema.specs:
            raise InvalidInputError(name, "must be sent as a tensor, not a request parameter")
        raise schema.unknown(name)
    return {name: parameters[name] for name in CONTROL_PARAMETERS if name in parameters}


def check_priority(priority: int, default_level: int, levels: int, sent_key: Any, key: str) -> None:
    """A level more urgent than the model's default (1 .. default_level - 1) needs the request parameter
    `priority_key` equal to the server's key (compared in constant time); with no key set nobody may pass
    the default. The default and the less urgent levels (and 0, the default) stay open to everyone."""
    if priority == 0 or priority >= default_level:
        return
    if key and isinstance(sent_key, str) and hmac.compare_digest(sent_key.encode(), key.encode()):
        return
    raise InvalidInputError("priority", f"{priority} is more urgent than the model's default level {default_level} "
                                        f"and needs the request parameter '{PRIORITY_KEY}'; without it send 0 or a "
                                        f"level in [{default_level}, {levels}]")
