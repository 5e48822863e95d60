#!/usr/bin/env bash
# The wheels benchmarks/device.sh installs on the GPU machine lent to some sessions (Python 3.12 with PyTorch,
# no network, no diffusers): the pinned diffusers of requirements.txt, and the pinned transformers as a fallback
# should the machine's own fail to build the tiny model. Into .whl/ (git-ignored, about 20 MB), carried with
# the call (`carry: [".whl"]`).
set -euo pipefail
cd "$(dirname "$0")/.."
pin() { grep -E "^$1==" requirements.txt; }
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "$(pin diffusers)" "$(pin transformers)"
ls -l .whl
