#!/usr/bin/env bash
# How to run the benchmarks on a GPU host: the engine on CUDA in bfloat16 with a larger random-weight
# preset (`gpu` where engine_lib.tiny_models has it, else `bench`; GPU_PRESET overrides), every scenario
# or the ones named (`bash benchmarks/gpu.sh modes,slo`). Needs a CUDA build of torch and tritonserver
# (the image of docker/Dockerfile has both). Results: benchmarks/results/gpu/<scenario>.json and .md.
# step-cache (`bash benchmarks/gpu.sh step-cache`) runs its first_block arm at CACHE_THRESHOLD when set: the
# threshold that reuses about half the steps differs per preset, and its table counts the steps reused.
# levers (`bash benchmarks/gpu.sh levers`, also part of every run) compares eager, regional compile (inductor),
# int8 and fp8 (dynamic e4m3, SM 8.9+) weights and compile+fp8, each with the step cache off and on, against eager
# float32 in-process, on a random-weight Qwen-Image of the release's size (20B transformer, built once on the GPU
# into models/qwen_image-release, about 43 GB in bfloat16) at 1024x1024: benchmarks/results/gpu/levers-release.*
# With more than one GPU it then runs the parallel configurations against one GPU (benchmarks/parallel.py:
# cfg_parallel and sequence_parallel_size=2 for Qwen-Image, sequence_parallel_size=2 for Flux,
# tensor_parallel_size for HunyuanImage-3.0, and with 4 GPUs cfg_parallel with sequence_parallel_size=2, a LoRA and
# the step cache at once): benchmarks/results/gpu/parallel.json and .md; `parallel` as the scenario runs only those.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu.sh: torch sees no CUDA device")'
PRESET=${GPU_PRESET:-$("$PY" -c 'from engine_lib.tiny_models import available; print("gpu" if "gpu" in available()["qwen_image"] else "bench")')}
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
