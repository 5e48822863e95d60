#!/usr/bin/env bash
# The benchmark on a CUDA host: the engine on CUDA in bfloat16 with a larger random-weight preset,
# REQUEST_BATCH serial / fused / fused+wait, STEP_BATCH and the naive baseline side by side (one
# tritonserver at a time), the offline limit and perf_analyzer. Writes benchmarks/results/gpu.json
# and docs/benchmarks-gpu.md (plots in docs/img/benchmarks-gpu-*.png). Extra arguments go to
# `python -m benchmarks.run` (e.g. --quick). Needs a CUDA build of torch (the GPU container has one).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu.sh: torch sees no CUDA device")'
# The "gpu" preset if engine_lib.tiny_models has one, else "bench" (override with GPU_PRESET).
PRESET=${GPU_PRESET:-$("$PY" -c 'from engine_lib.tiny_models import available; print("gpu" if "gpu" in available()["qwen_image"] else "bench")')}
# Host synchronisations per engine tick first, every pipeline (a few minutes): benchmarks/results/gpu_sync.json.
"$PY" -m benchmarks.gpu_sync --preset "$PRESET" --size "${GPU_SIZE:-512}"
# One forward over rows of two and of eight sizes (512 to 1024 px), packed vs per size vs padded, per pipeline:
# benchmarks/results/packing-gpu.json, rendered into docs/benchmarks-gpu.md's GPU section.
"$PY" -m benchmarks.packing --device cuda --dtype bfloat16 --scale 4 --out packing-gpu.json --no-report
exec "$PY" -m benchmarks.run --device cuda --dtype bfloat16 --preset "$PRESET" \
  --size "${GPU_SIZE:-512}" --steps "${GPU_STEPS:-20}" --max-wait 0 \
  --out benchmarks/results/gpu.json --doc docs/benchmarks-gpu.md "$@"
