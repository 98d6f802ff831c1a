#!/usr/bin/env bash
# Prepares, on a machine with a package index, the wheels tests/gpu/device_check.sh installs on the
# GPU machine (which reaches no index: Python 3.12, torch + CUDA + NCCL + numpy only). Each call of
# the device tool carries at most 64 MiB, so the wheels come in folders to carry in separate calls
# while the machine stays warm (device_check.sh installs into .gpu-site/, which persists between them):
#   DIR/base  pytest and what tests/gpu and the pdserve modules they reach import (~10 MB)
#   DIR/nixl  nixl-cu13 (~57 MB; the NIXL VRAM check)
#   DIR/fi1   base + the first half of flashinfer-python 0.7.4 (~60 MB)
#   DIR/fi2   its second half + its small dependencies and cuda-bindings (~59 MB)
#   DIR/fi3   the rest of its dependencies (~47 MB). nvidia-cutlass-dsl's CUDA libraries (92 MB)
#             are left out: flashinfer 0.7.4 imported without them on the H200 run, and the kernels
#             pdserve calls are JIT-built with nvcc
# usage: tests/gpu/fetch_wheels.sh [DIR]   (default gpu-wheels/, gitignored)
#
# Guarded by a CPU test, tests/test_gpu_imports.py (make test), which reads the *_WHEELS arrays: it
# imports every tests/gpu module, and every pdserve module they reach, in a process that refuses any
# module outside the stdlib, the device image's torch / numpy / triton and what BASE_WHEELS and
# NIXL_WHEELS provide; a new run-time import fails it, naming the module to add here.
# One requirement a word; installed with --no-deps, so every dependency is listed too.
set -euo pipefail
BASE_WHEELS=(
    pytest pluggy iniconfig packaging pygments  # pytest >= 8.4 imports pygments
    safetensors tokenizers msgpack pyzmq  # jinja2, markupsafe: torch's, in the image
    'llguidance>=1.9,<2'  # engine/constraint.py, imported by the servers (pyproject's pin)
)
NIXL_WHEELS=(nixl-cu13==1.5.1)
FI1_WHEELS=(flashinfer-python==0.7.4)
FI2_WHEELS=(apache-tvm-ffi ninja einops click tabulate tqdm requests idna certifi urllib3
    charset-normalizer nvidia-ml-py cuda-tile cuda-pathfinder cuda-bindings)
FI3_WHEELS=(cuda-core nvidia-cudnn-frontend nccl4py nccl-extensions nvidia-cutlass-dsl-libs-core
    nvidia-cutlass-dsl-libs-base cuda-python nvidia-cutlass-dsl)
DIR=${1:-gpu-wheels}
PY=${PY:-python3}
# manylinux_2_31: llguidance's wheel (cp39-abi3); the GPU machine has glibc 2.39
PLATFORMS=(--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64
    --platform manylinux_2_17_x86_64 --platform any)
dl() {
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 "${PLATFORMS[@]}" -d "$@"
}
mkdir -p "$DIR/base" "$DIR/nixl" "$DIR/fi1" "$DIR/fi2" "$DIR/fi3"
dl "$DIR/base" "${BASE_WHEELS[@]}"
dl "$DIR/nixl" "${NIXL_WHEELS[@]}"
cp "$DIR"/base/*.whl "$DIR/fi1/"
dl "$DIR/fi1" "${FI1_WHEELS[@]}"
for whl in "$DIR"/fi1/flashinfer_python-*.whl; do
    split -b 50M -d "$whl" "$whl.part-" && rm "$whl"  # NAME.whl.part-00, -01: device_check.sh joins them
    mv "$whl.part-01" "$DIR/fi2/"
done
dl "$DIR/fi2" "${FI2_WHEELS[@]}"
dl "$DIR/fi3" "${FI3_WHEELS[@]}"
du -sh "$DIR"/*
