"""The execution mode of an engine (docs/architecture.md, Execution modes): chosen once at load from the config and
what the adapter declares it runs."""

from __future__ import annotations

import enum
from typing import Any

from engine_lib.config import ConfigError, EngineConfig
from engine_lib.pipelines.capabilities import check


class EngineMode(enum.Enum):
    REQUEST_BATCH = "request_batch"
    STEP_BATCH = "step_batch"


def select_mode(config: EngineConfig, adapter: Any) -> EngineMode:
    """The execution-mode table (docs/architecture.md), after the one check of what the config turns on
    against what the adapter (a class or an instance) declares it runs (pipelines/capabilities.py)."""
    capabilities = adapter.capabilities
    check(adapter.name, capabilities, config)
    if config.scheduler.step_execution:
        if config.scheduler.max_num_seqs > capabilities.max_step_batch:
            raise ConfigError(f"pipeline '{adapter.name}' advances at most {capabilities.max_step_batch} request(s) "
                              f"per step: set max_num_seqs={capabilities.max_step_batch} (or lower)")
        return EngineMode.STEP_BATCH
    return EngineMode.REQUEST_BATCH
