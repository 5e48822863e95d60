"""benchmarks/gpu.sh and benchmarks/parallel.py cannot run here (no GPU): their syntax, and that every parallel
configuration they run is one the engine's parameters accept."""

from __future__ import annotations

import subprocess

from benchmarks.parallel import configs
from engine_lib.config import EngineConfig
from engine_lib.pipelines.tiny_models import REPO_ROOT


def test_gpu_sh_parses():
    subprocess.run(["bash", "-n", str(REPO_ROOT / "benchmarks" / "gpu.sh")], check=True)


def test_every_parallel_configuration_is_a_valid_engine_config():
    for gpus in (2, 4, 8):
        for pipeline, parameters, _ in configs(gpus):
            config = EngineConfig.of(pipeline=pipeline, **parameters)
            config.validate()
            assert 1 < config.parallel.world_size <= max(gpus, 4)  # main() skips the 4-rank combination on fewer GPUs
