#!/usr/bin/env bash
# Downloads every wheel the CPU image needs into a wheelhouse on the host, so that
# `docker build` installs them with `pip install --no-index --find-links` and never reaches an index
# from inside the container (an air-gapped build):
#
#   deploy/wheelhouse.sh                 # -> deploy/wheelhouse/ (the Dockerfile's default WHEELHOUSE)
#   deploy/wheelhouse.sh DIR
#
# The wheels are for the image's Python (CPython 3.11, manylinux x86_64, glibc 2.36 = Debian bookworm),
# whatever Python runs this script. torch is the pinned CPU build (TORCH_VERSION, default 2.13.0)
# from the PyTorch CPU index, never the CUDA build. The download is cached under
# ~/.cache/pdserve/wheelhouse-<key> (key: pyproject.toml and this script), so a rerun on the same
# machine only copies it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/deploy/wheelhouse}
py=${PYTHON:-python3}
torch_version=${TORCH_VERSION:-2.13.0}
torch_index=${TORCH_INDEX_CPU:-https://download.pytorch.org/whl/cpu}
key=$(cat "$root/pyproject.toml" "$0" | sha256sum | cut -c1-12)
cache=${PDSERVE_CACHE:-$HOME/.cache/pdserve}/wheelhouse-cpu-$key

if [ ! -f "$cache/.complete" ]; then
    rm -rf "$cache.tmp"
    mkdir -p "$cache.tmp"
    # the project's runtime dependencies, read from pyproject.toml
    mapfile -t deps < <("$py" - "$root/pyproject.toml" <<'EOF'
import sys, tomllib
print(*tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"], sep="\n")
EOF
)
    # pip takes the platform tags literally: every manylinux tag glibc 2.36 runs
    target=(--only-binary :all: --python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none)
    for minor in $(seq 36 -1 17); do target+=(--platform "manylinux_2_${minor}_x86_64"); done
    target+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64
             --platform any)
    # torch alone first (its CPU build), then everything else resolved against it: nixl-cu13 depends
    # on an unpinned torch, which must not pull the CUDA build from PyPI
    # (the PyTorch index only when it answers: pip retries an unreachable one for minutes, and a
    # find-links directory of pip's configuration may hold the wheel already)
    index=()
    if curl -fsS -m 10 -o /dev/null "$torch_index/torch/"; then index=(--extra-index-url "$torch_index"); fi
    "$py" -m pip download -q "${target[@]}" --no-deps -d "$cache.tmp" "${index[@]}" "torch==${torch_version}+cpu"
    "$py" -m pip download -q "${target[@]}" -d "$cache.tmp" --find-links "$cache.tmp" \
        "torch==${torch_version}+cpu" "${deps[@]}" pip "setuptools>=77.0.3"
    if ls "$cache.tmp" | grep -E '^(nvidia|triton)' >&2; then
        echo "wheelhouse: CUDA wheels were pulled in (above); refusing" >&2
        exit 1
    fi
    touch "$cache.tmp/.complete"
    rm -rf "$cache"
    mv "$cache.tmp" "$cache"
fi

mkdir -p "$out"
find "$out" -maxdepth 1 -name '*.whl' -delete
# hard links when the cache and the build context share a file system, copies otherwise
cp -l "$cache"/*.whl "$out"/ 2>/dev/null || cp "$cache"/*.whl "$out"/
echo "wheelhouse: $(ls "$out"/*.whl | wc -l) wheels, $(du -sh "$cache" | cut -f1), in $out"
