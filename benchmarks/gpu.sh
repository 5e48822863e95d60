#!/usr/bin/env bash
# The benchmarks on a GPU host: every scenario (or the ones named: `bash benchmarks/gpu.sh modes,slo`) on CUDA in
# bfloat16 with the `gpu` preset (GPU_PRESET overrides; CACHE_THRESHOLD sets step-cache's threshold); with no names,
# levers on a random-weight release-size Qwen-Image at 1024x1024 (`levers` alone skips the scenarios); with more than
# one GPU, last, benchmarks/parallel.py (`parallel` alone runs only that). docs/benchmarks.md, On a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu.sh: torch sees no CUDA device")'
PRESET=${GPU_PRESET:-$("$PY" -c 'from engine_lib.pipelines.tiny_models import available; print("gpu" if "gpu" in available()["qwen_image"] else "bench")')}
if [ "${1:-}" != parallel ] && [ "${1:-}" != levers ]; then
  "$PY" -m benchmarks.run --device cuda --dtype bfloat16 --preset "$PRESET" --out benchmarks/results/gpu \
    --scenario "${1:-}" ${CACHE_THRESHOLD:+--cache-threshold "$CACHE_THRESHOLD"}
fi
case ",${1:-levers}," in
  *,levers,*) "$PY" -m benchmarks.levers --device cuda --dtype bfloat16 --preset release --size 1024 \
                --out benchmarks/results/gpu/levers-release ;;
esac
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "$GPUS" -gt 1 ]; then
  "$PY" -m benchmarks.parallel --device cuda --dtype bfloat16 --preset "$PRESET" --out benchmarks/results/gpu
else
  echo "gpu.sh: skipped the parallel configurations (cfg_parallel, sequence_parallel_size, tensor_parallel_size): $GPUS GPU"
fi
