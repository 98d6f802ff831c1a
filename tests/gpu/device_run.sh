#!/usr/bin/env bash
# One call of the device tool, prepared: the device check (tests/gpu, the triton kernels included),
# then bench/gpu_layer.py, each writing its JSON under $OUT as it goes. Budget: about 7 minutes.
#
# usage: tests/gpu/device_run.sh WHEEL_DIR   (tests/gpu/fetch_wheels.sh's base folder, carried)
#   CHECK_TIMEOUT (default 200 s), BENCH_CAP_S (default 240 s), BENCH_ARGS: passed through
#   CHECK=0: the wheels installed, the bench alone
#   NIXL=1: the NIXL VRAM check and bench/gpu_nixl.py (NIXL_CAP_S, default 150 s) run too
#   (nixl-cu13 installed by an earlier INSTALL_ONLY call: its
#   57 MB do not fit beside base in one call); without it that check is left out (device_check.json then lists no NIXL check)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
# the device check installs the wheels into .gpu-site/ and runs tests/gpu
if [ "${NIXL:-0}" != 1 ]; then export PYTEST_ARGS="${PYTEST_ARGS:-} --ignore=tests/gpu/test_nixl_vram.py"; fi
if [ "${CHECK:-1}" = 1 ]; then
    CHECK_TIMEOUT=${CHECK_TIMEOUT:-200} tests/gpu/device_check.sh "$1" "$OUT/device_check.json" 2>&1 | tail -60
else
    INSTALL_ONLY=1 tests/gpu/device_check.sh "$1"
fi
export PYTHONPATH="$PWD:$PWD/.gpu-site${PYTHONPATH:+:$PYTHONPATH}"
if [ "${NIXL:-0}" = 1 ]; then  # the VRAM WRITE by size and UCX setting (issue 41), about a minute
    timeout -k 10 "${NIXL_CAP_S:-150}" python3 bench/gpu_nixl.py --out "$OUT/gpu_nixl.json" 2>&1 | tail -30
    echo "gpu_nixl exit: ${PIPESTATUS[0]}"
fi
timeout -k 10 $(( ${BENCH_CAP_S:-240} + 60 )) python3 bench/gpu_layer.py --out "$OUT/gpu_layer.json" \
    --total-cap-s "${BENCH_CAP_S:-240}" ${BENCH_ARGS:-} 2>&1 | tail -80
echo "bench exit: ${PIPESTATUS[0]}"
