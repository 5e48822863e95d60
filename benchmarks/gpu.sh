#!/usr/bin/env bash
# How to run the benchmarks on a GPU host: the engine on CUDA in bfloat16 with a larger random-weight
# preset (`gpu` where engine_lib.tiny_models has it, else `bench`; GPU_PRESET overrides), every scenario
# or the ones named (`bash benchmarks/gpu.sh modes,slo`). Needs a CUDA build of torch and tritonserver
# (the image of docker/Dockerfile has both). Results: benchmarks/results/gpu/<scenario>.json and .md.
# step-cache (`bash benchmarks/gpu.sh step-cache`) runs its first_block arm at CACHE_THRESHOLD when set: the
# threshold that reuses about half the steps differs per preset, and its table counts the steps reused.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu.sh: torch sees no CUDA device")'
PRESET=${GPU_PRESET:-$("$PY" -c 'from engine_lib.tiny_models import available; print("gpu" if "gpu" in available()["qwen_image"] else "bench")')}
exec "$PY" -m benchmarks.run --device cuda --dtype bfloat16 --preset "$PRESET" --out benchmarks/results/gpu \
  --scenario "${1:-}" ${CACHE_THRESHOLD:+--cache-threshold "$CACHE_THRESHOLD"}
