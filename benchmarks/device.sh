#!/usr/bin/env bash
# Issue #13's scheduling targets on the GPU machine lent to some sessions: an H200 whose image has PyTorch but
# no tritonserver, no diffusers and no network, so the engine runs in-process (benchmarks/scheduling.py
# --plan gpu: the `gpu` preset in bfloat16, `make bench`'s workloads). About 5 minutes is the plan's guess
# (never run yet).
#
#   here:        bash scripts/device_wheels.sh                  # diffusers (+ a fallback transformers) into .whl/
#   the device:  run(command="bash benchmarks/device.sh", carry=[".whl"], timeout_s=540)
#   here again:  cp <files_at>/scheduling-gpu.json benchmarks/results/ && .venv/bin/python -m benchmarks.report
#
# Everything goes to $OUT (the log too); the results are saved after every stage, so a run cut short still
# returns what it measured. Extra arguments go to benchmarks.scheduling (e.g. --repeats 1).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device-out}
SITE=/tmp/device-site
PY=${PYTHON:-python3}
mkdir -p "$OUT"
install() { "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@"; }
install .whl/diffusers-*.whl
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt" || true
# The image's transformers first; the pinned one only if the tiny model does not build with it.
if ! "$PY" -c 'from engine_lib.tiny_models import build_pipeline; build_pipeline("qwen_image", "tiny")' \
    >"$OUT/preflight.log" 2>&1; then
  echo "device.sh: the image's transformers failed the tiny build (preflight.log); installing the pinned one"
  install .whl/transformers-*.whl
fi
"$PY" -m benchmarks.scheduling --plan gpu --no-report --out "$OUT/scheduling-gpu.json" "$@" 2>&1 \
  | grep --line-buffered -v "it/s\]" | tee "$OUT/scheduling-gpu.log"
