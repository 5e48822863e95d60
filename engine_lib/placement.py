"""Device placement: where one Triton model instance's engine and its ranks run (its `instance_group` kind and
device id against the `device` and `devices` parameters)."""

from __future__ import annotations

from engine_lib.config import ConfigError, EngineConfig


def for_instance(config: EngineConfig, kind: str, device_id: str) -> EngineConfig:
    """This config for one Triton model instance (its `instance_group` kind and device id).

    KIND_GPU places each instance's engine on the GPU Triton assigned it (`gpus: [...]`,
    `count` per GPU), KIND_CPU on the CPU; KIND_MODEL leaves the choice to `device`. A
    `device` that contradicts the kind fails the load rather than being ignored.

    An instance of several ranks (world_size > 1) spans devices, which Triton's one device per
    instance cannot say: it takes KIND_MODEL, its ranks on `devices` (empty: cuda:0..N-1 on a GPU
    host, else the CPU) and its engine on rank 0's device unless `device` says otherwise; KIND_CPU
    runs every rank on the CPU; KIND_GPU is refused (it would stack the ranks' instances on GPUs
    Triton picks, each instance's ranks on the same devices).
    """
    kind = (kind or "MODEL").upper()
    if config.parallel.world_size > 1:
        return _for_ranks(config, kind)
    if kind == "GPU":
        wanted = f"cuda:{int(device_id)}"
    elif kind == "CPU":
        wanted = "cpu"
    else:
        return config
    if config.model.device not in ("auto", wanted) and not (kind == "GPU" and config.model.device == "cuda"):
        raise ConfigError(f"parameter 'device': {config.model.device!r} contradicts instance_group kind KIND_{kind} "
                          f"(this instance is on {wanted}); leave device=auto, or use KIND_MODEL to pick "
                          "the device with this parameter")
    return config.replace(device=wanted)


def _for_ranks(config: EngineConfig, kind: str) -> EngineConfig:
    names, world_size = config.parallel.device_list(), config.parallel.world_size
    if kind == "GPU":
        raise ConfigError(f"instance_group kind KIND_GPU: this instance runs {world_size} ranks on "
                          f"{world_size} devices; use instance_group [ {{ count: 1, kind: KIND_MODEL }} ] "
                          "and name the ranks' devices with parameter 'devices' (e.g. cuda:0,cuda:1)")
    if kind == "CPU":
        if any(name != "cpu" for name in names) or config.model.device not in ("auto", "cpu"):
            raise ConfigError(f"parameter 'devices': {config.parallel.devices!r} (device {config.model.device!r}) "
                              "contradicts instance_group kind KIND_CPU; leave them empty, or use KIND_MODEL")
        return config.replace(device="cpu")
    if names and config.model.device == "auto":
        return config.replace(device=names[0])
    return config
