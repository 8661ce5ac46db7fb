#!/usr/bin/env bash
# A base image from Debian's own packages, for machines that reach no image registry: debootstrap a minimal
# bookworm (python3.11 with venv and pip, redis-server, curl, libnuma) and import it. It serves as PYTHON_IMAGE (the
# light, cpu and vllm-cpu builds) and as REDIS_IMAGE (compose's redis runs `redis-server`, `redis-cli` from it).
#   deploy/build-base-image.sh [IMAGE] [MIRROR]     (defaults: eagle3q-base:bookworm, the mirror apt uses here)
# Needs root, debootstrap and a Docker engine; about a minute and 300 MB.
set -euo pipefail
IMAGE=${1:-eagle3q-base:bookworm}
MIRROR=${2:-$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
ROOTFS=$(mktemp -d /var/tmp/eagle3q-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT
debootstrap --variant=minbase \
  --include=python3,python3-venv,python3-pip,redis-server,ca-certificates,curl,procps,libnuma1 \
  bookworm "$ROOTFS" "$MIRROR" >/dev/null
# apt's lists and caches add nothing an image needs
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
tar -C "$ROOTFS" -c . | docker import -c 'CMD ["/bin/bash"]' - "$IMAGE" >/dev/null
echo "$IMAGE"
