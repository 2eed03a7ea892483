#!/usr/bin/env bash
# Prepares, on this (CPU) machine, what tests/gpu/device_run.sh needs on a GPU machine that
# cannot download: Keras and its two missing dependencies as wheels in .whl/ (for the
# Keras-on-torch GPU test) and the manylinux wheel in .wheel-gpu/ (issue 32's GPU check), built
# with a torch allocator for the GPU machine's torch minor too. Both folders are ignored by git
# (.git/info/exclude) and travel with the device call when named in its `carry`. From the
# repository root:
#
#   bash scripts/prepare_device_run.sh [GPU_TORCH_VERSION]    # default 2.11.0 (the H200 image)
#
# then, in device calls that carry .whl and .wheel-gpu (each under the 10-minute limit):
#   bash tests/gpu/device_run.sh build test
#   bash tests/gpu/device_run.sh build latency wheel
#   bash tests/gpu/device_run.sh build hosts        # the bed's CUDA tests, where it can run
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${1:-2.11.0}
PY=${PYTHON:-.venv/bin/python}
for d in /.whl/ /.wheel-gpu/; do
    grep -qx "$d" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "$d" >> .git/info/exclude; }
done
KERAS=$("$PY" -c "import keras; print(keras.__version__)")
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "keras==$KERAS" namex optree
TORCH_DIR=${TMPDIR:-/tmp}/spark_hvd-torch-$TORCH_VERSION
mkdir -p "$TORCH_DIR"
ls "$TORCH_DIR"/torch-*.whl > /dev/null 2>&1 || \
    "$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
        --python-version 3.11 --implementation cp -d "$TORCH_DIR" "torch==$TORCH_VERSION"
make wheel TORCH_WHEELS="$(ls "$TORCH_DIR"/torch-*.whl | head -1)"
rm -rf .wheel-gpu && mkdir -p .wheel-gpu && cp dist/spark_hvd-*.whl .wheel-gpu/
du -sh .whl .wheel-gpu
