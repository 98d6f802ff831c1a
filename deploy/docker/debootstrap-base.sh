#!/usr/bin/env bash
# Makes a local base image for deploy/docker/Dockerfile when no image registry is reachable:
# a minimal Debian bookworm (debootstrap --variant=minbase) with what the Dockerfile would otherwise
# install with apt (python3, python3-venv, curl, ca-certificates, libnuma1), imported with
# `docker import`. Needs root, debootstrap, and a Debian mirror (MIRROR, default deb.debian.org).
#
#   deploy/docker/debootstrap-base.sh [IMAGE]      # default IMAGE: pdserve-base:bookworm
#   docker build -f deploy/docker/Dockerfile --build-arg BASE_IMAGE=pdserve-base:bookworm ...
#
# The root file system is cached as a tarball under ~/.cache/pdserve/ (key: this script), so a rerun
# on the same machine only imports it. DOCKER (default docker) is the client to import with.
set -euo pipefail
image=${1:-pdserve-base:bookworm}
mirror=${MIRROR:-http://deb.debian.org/debian}
docker=${DOCKER:-docker}
packages=python3,python3-venv,curl,ca-certificates,libnuma1
key=$(sha256sum "$0" | cut -c1-12)
tarball=${PDSERVE_CACHE:-$HOME/.cache/pdserve}/base-bookworm-$key.tar

if [ ! -f "$tarball" ]; then
    mkdir -p "$(dirname "$tarball")"
    rootfs=$(mktemp -d /tmp/pdserve-rootfs.XXXXXX)
    trap 'rm -rf "$rootfs"' EXIT
    debootstrap --variant=minbase --include="$packages" bookworm "$rootfs" "$mirror" >&2
    # no apt lists, caches, logs, documentation or translations in the image
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/log/* \
        "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*
    tar -C "$rootfs" --numeric-owner -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
fi
"$docker" import "$tarball" "$image" >/dev/null
echo "base image: $image ($(du -h "$tarball" | cut -f1) root file system)"
