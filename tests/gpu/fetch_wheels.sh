#!/usr/bin/env bash
# Prepares, on a machine with a package index, the wheels tests/gpu/device_check.sh installs on the
# GPU machine (which reaches no index: Python 3.12, torch + CUDA + NCCL only). Each call of the
# device tool carries at most 64 MiB, so the wheels come in parts to carry in separate calls while
# the machine stays warm (device_check.sh installs into .gpu-site/, which persists between them):
#   DIR/base        pytest and pdserve's rank-process imports (~6 MB)
#   DIR/nixl        nixl-cu13 (~59 MB; the NIXL VRAM check)
#   DIR/flashinfer  flashinfer-python split in two parts (~101 MB; its own dependencies --
#                   apache-tvm-ffi, cuda-python, nvidia-cutlass-dsl, ... -- are NOT included: the
#                   flashinfer checks skip unless they are present on the GPU machine)
# usage: tests/gpu/fetch_wheels.sh [DIR]   (default gpu-wheels/, gitignored)
set -euo pipefail
DIR=${1:-gpu-wheels}
PY=${PY:-python3}
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any)
dl() {
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 "${PLATFORMS[@]}" -d "$@"
}
mkdir -p "$DIR/base" "$DIR/nixl" "$DIR/flashinfer"
dl "$DIR/base" pytest pluggy iniconfig packaging safetensors tokenizers msgpack pyzmq jinja2 markupsafe
dl "$DIR/nixl" nixl-cu13==1.5.1
dl "$DIR/flashinfer" flashinfer-python==0.7.4
for whl in "$DIR"/flashinfer/*.whl; do
    split -b 50M -d "$whl" "$whl.part-" && rm "$whl"  # NAME.whl.part-00, -01: device_check.sh joins them
done
du -sh "$DIR"/*
