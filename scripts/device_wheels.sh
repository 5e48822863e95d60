#!/usr/bin/env bash
# Wheels for a GPU host without network access whose Python 3.12 has PyTorch but no diffusers: the pinned
# diffusers of requirements.txt, and the pinned transformers as a fallback should the host's own fail to build
# the tiny models. Into .whl/ (git-ignored); copy it there with the repository and install with
# `pip install --no-index --no-deps .whl/*.whl`.
set -euo pipefail
cd "$(dirname "$0")/.."
pin() { grep -E "^$1==" requirements.txt; }
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "$(pin diffusers)" "$(pin transformers)"
ls -l .whl
