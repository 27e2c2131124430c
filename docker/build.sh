#!/usr/bin/env bash
# Build the fedsplit image with BuildKit (docker/Dockerfile needs it: build secret, per-Dockerfile
# ignore file), from the repository root, whichever client this machine has:
#
#   docker/build.sh [-t TAG] [--base-image IMAGE] [--extra-ca FILE] [-- EXTRA DOCKER BUILD ARGS]
#
#   docker/build.sh                                       # connected: python:3.11-slim, pip's index
#   make wheelhouse && docker/build.sh                    # packages from wheelhouse/ only (--no-index)
#   make base-image wheelhouse && docker/build.sh --base-image fedsplit-base:bookworm   # air-gapped
#
# --extra-ca FILE: a CA (PEM) that pip trusts during the build only (a TLS-inspecting proxy),
# passed as the build secret `extra_ca`; it is not stored in the image. The client: `docker buildx
# build` when the buildx plugin is there, else `docker build` with DOCKER_BUILDKIT=1 from a client
# that has BuildKit built in (Docker 18.09-22.x, e.g. Debian 12's docker.io at /usr/bin/docker).
set -euo pipefail

TAG="${FEDSPLIT_IMAGE:-fedsplit:latest}"
BASE_IMAGE="${BASE_IMAGE:-python:3.11-slim}"
EXTRA_CA=""
EXTRA=()
fail() { echo "build: $1" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        -t|--tag) TAG="${2:?-t needs a tag}"; shift 2 ;;
        --base-image) BASE_IMAGE="${2:?--base-image needs an image}"; shift 2 ;;
        --extra-ca) EXTRA_CA="${2:?--extra-ca needs a PEM file}"; shift 2 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) fail "unknown option; use -t, --base-image, --extra-ca or -- DOCKER-BUILD-ARGS. Received: $1" ;;
    esac
done
[ -z "$EXTRA_CA" ] || [ -s "$EXTRA_CA" ] || fail "--extra-ca must be a non-empty PEM file. Received: $EXTRA_CA"
cd "$(dirname "$0")/.."

# A BuildKit-capable `docker build` command line, or nothing.
buildkit_client() {
    local client
    for client in docker /usr/bin/docker; do
        command -v "$client" >/dev/null 2>&1 || continue
        if "$client" buildx version >/dev/null 2>&1; then echo "$client buildx build --load"; return 0; fi
        # Clients before 23.0 build with BuildKit themselves when DOCKER_BUILDKIT=1.
        local major
        major=$("$client" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1)
        if [ -n "$major" ] && [ "$major" -lt 23 ] 2>/dev/null; then echo "$client build"; return 0; fi
    done
    return 1
}
BUILD=$(buildkit_client) || fail "no BuildKit-capable docker client: install the buildx plugin (Docker >= 23) \
or Debian's docker.io (its /usr/bin/docker builds with DOCKER_BUILDKIT=1). Received: $(command -v docker || echo 'no docker')"

ARGS=(-f docker/Dockerfile -t "$TAG" --build-arg "BASE_IMAGE=$BASE_IMAGE")
[ -z "${TORCH_PIP_ARGS:-}" ] || ARGS+=(--build-arg "TORCH_PIP_ARGS=$TORCH_PIP_ARGS")
[ -z "$EXTRA_CA" ] || ARGS+=(--secret "id=extra_ca,src=$EXTRA_CA")
if ls wheelhouse/*.whl >/dev/null 2>&1; then source="wheelhouse/ (no package index)"; else source="the package index"; fi
echo "build: $TAG from $BASE_IMAGE, packages from $source ($BUILD)"
# shellcheck disable=SC2086  # BUILD is a command line
DOCKER_BUILDKIT=1 $BUILD "${ARGS[@]}" "${EXTRA[@]}" .
