#!/usr/bin/env bash
# The prepared device check of the CUDA path (README, "GPU"): installs the carried wheels, prints
# the environment, runs tests/gpu and writes a JSON summary. Budget: under 5 minutes on one GPU.
#
# usage: tests/gpu/device_check.sh [WHEEL_DIR] [OUT_JSON]
#   WHEEL_DIR  wheels to install (tests/gpu/fetch_wheels.sh makes them; *.whl.part-NN files are
#              joined first); installed with --no-index --no-deps into .gpu-site/ (gitignored), which
#              stays between calls while the machine is warm, so the wheels can come in several calls
#   OUT_JSON   default: $OUT/device_check.json when $OUT is set (the device tool's output folder),
#              else bench/results/device_check.json
#   INSTALL_ONLY=1 in the environment: install and stop (an earlier call of a multi-call carry)
#   PYTEST_ARGS, CHECK_TIMEOUT (default 270 s) in the environment: a selection (-k ...) and the limit
# Exit status: pytest's (0 only when every collected check passed).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
WHEELS=${1:-}
if [ -n "${2:-}" ]; then OUT_JSON=$2; elif [ -n "${OUT:-}" ]; then OUT_JSON=$OUT/device_check.json; else OUT_JSON=bench/results/device_check.json; fi
SITE=$PWD/.gpu-site
START=$(date +%s)
mkdir -p "$SITE" "$(dirname "$OUT_JSON")"

if [ -n "$WHEELS" ]; then
    # parts of a split wheel may come in different calls: they wait in .gpu-site/parts/ until the
    # joined file is a whole zip (its central directory is at the end)
    mkdir -p "$SITE/parts"
    find "$WHEELS" -name '*.whl.part-*' -exec cp {} "$SITE/parts/" \;
    for part in "$SITE"/parts/*.whl.part-00; do
        [ -e "$part" ] || continue
        whl=$SITE/$(basename "${part%.part-00}")
        cat "${part%.part-00}".part-* > "$whl"
        if $PY -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1])' "$whl" 2>/dev/null; then
            rm -f "${part%.part-00}".part-*
        else
            echo "$(basename "$whl"): not all parts are here yet"; rm -f "$whl"
        fi
    done
    wheels=$(find "$WHEELS" "$SITE" -maxdepth 1 -name '*.whl')
    if [ -n "$wheels" ]; then
        if $PY -m pip --version >/dev/null 2>&1; then
            $PY -m pip install --quiet --no-index --no-deps --upgrade --target "$SITE" $wheels || echo "warning: pip install failed"
        else  # no pip: a wheel is a zip of its installed files
            for w in $wheels; do $PY -m zipfile -e "$w" "$SITE"; done
        fi
        rm -f "$SITE"/*.whl
    fi
fi
if [ -n "${INSTALL_ONLY:-}" ]; then echo "installed into $SITE"; exit 0; fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
unset PYTORCH_CUDA_ALLOC_CONF  # no expandable segments: NIXL registers pool memory
# UCX's CUDA transports (cuda_copy, cuda_ipc) ship inside the nixl-cu13 wheel
ucx=$(find "$SITE" $($PY -c 'import site; print(" ".join(site.getsitepackages()))') -name 'libuct_cuda*.so*' 2>/dev/null | head -1)
if [ -n "$ucx" ]; then export UCX_MODULE_DIR=$(dirname "$ucx"); fi

ENV_JSON=$(mktemp)
$PY - "$ENV_JSON" <<'PYEOF'
import importlib.metadata as md, json, os, platform, subprocess, sys
import torch
env = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
       "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
       "ucx_module_dir": os.environ.get("UCX_MODULE_DIR")}
if torch.cuda.is_available():
    env.update(gpu=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
               gpus=torch.cuda.device_count(), nccl=".".join(map(str, torch.cuda.nccl.version())))
for tool, args in (("nvcc", ["nvcc", "--version"]), ("nvidia_smi", ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])):
    try:
        env[tool] = subprocess.run(args, capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[-1]
    except Exception as e:
        env[tool] = f"unavailable: {e}"
pkgs = {}
for name in ("pytest", "nixl-cu13", "flashinfer-python", "safetensors", "tokenizers", "msgpack", "pyzmq", "llguidance"):
    try:
        pkgs[name] = md.version(name)
    except md.PackageNotFoundError:
        pkgs[name] = None
env["packages"] = pkgs
print(json.dumps(env, indent=1))
json.dump(env, open(sys.argv[1], "w"))
PYEOF

JUNIT=$(mktemp --suffix .xml)
# SIGINT first: pytest then still writes its report (and the junit file) for what ran
export MAX_JOBS=${MAX_JOBS:-$(nproc)}  # flashinfer's JIT builds its kernels with this many jobs
timeout -s INT -k 20 "${CHECK_TIMEOUT:-270}" $PY -m pytest tests/gpu ${PYTEST_ARGS:-} -v -rA --confcutdir=tests/gpu -p no:cacheprovider --junitxml="$JUNIT"
RC=$?
$PY tests/gpu/summary.py "$JUNIT" "$ENV_JSON" "$OUT_JSON" "$RC" "$(( $(date +%s) - START ))"
exit $RC
