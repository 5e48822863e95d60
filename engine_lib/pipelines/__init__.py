"""Pipeline adapters: the contract (`base`), one module per diffusers pipeline, and the registry."""

from engine_lib.pipelines.registry import ADAPTERS, get_adapter_class, load_adapter

__all__ = ["ADAPTERS", "get_adapter_class", "load_adapter"]
