#!/usr/bin/env bash
# Base images for a host with no image registry: Debian 12 made from Debian's packages with mmdebstrap, then
# `docker import`ed. An image already present is kept.
#
#   tests/compose/base_images.sh [PYTHON_TAG] [REDIS_TAG]     (defaults: upesi-python:bookworm upesi-redis:bookworm)
#
# The Python image is what the Dockerfile's PYTHON_IMAGE needs (python3 with venv, `python`, groupadd); the Redis
# image runs compose's redis service (redis-server, and redis-cli for its health check).
set -euo pipefail

PYTHON_TAG=${1:-upesi-python:bookworm}
REDIS_TAG=${2:-upesi-redis:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

make_image() {
    local tag=$1 include=$2
    if docker image inspect "$tag" >/dev/null 2>&1; then
        echo "$tag: present"
        return
    fi
    local tmp
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' RETURN
    mmdebstrap --quiet --variant=minbase --include="$include" bookworm "$tmp/rootfs.tar" "$MIRROR"
    docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        "$tmp/rootfs.tar" "$tag" >/dev/null
    echo "$tag: built ($(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1 / 1e6}'))"
}

make_image "$PYTHON_TAG" python3,python3-venv,python-is-python3,passwd,ca-certificates
make_image "$REDIS_TAG" redis-server,redis-tools
