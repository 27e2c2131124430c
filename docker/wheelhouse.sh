#!/usr/bin/env bash
# Download every wheel the fedsplit image installs into a wheelhouse, on a machine that can reach
# a package index, so that the image builds with no network (`--no-index --find-links`):
#
#   docker/wheelhouse.sh [DIR]            # default wheelhouse/ (git-ignored); `make wheelhouse`
#   TORCH_PIP_ARGS="--index-url URL" docker/wheelhouse.sh   # torch from another wheel index
#
# The list comes from docker/requirements.py (torch==TORCH_VERSION, fedsplit's dependencies,
# hatchling) plus openmined-psi without dependencies. torch is fetched first, alone (with
# TORCH_PIP_ARGS, e.g. the CPU-only index of pytorch.org's install selector; empty = pip's own
# configuration), and the rest is resolved against it. Wheels are for the interpreter that runs
# pip, so run this with CPython 3.11 on x86_64 Linux (the image's), glibc <= 2.36 (Debian 12).
# An existing complete wheelhouse for the same list is kept; delete DIR to refresh it.
set -euo pipefail

OUT="${1:-wheelhouse}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCH_PIP_ARGS="${TORCH_PIP_ARGS:-}"
HERE="$(cd "$(dirname "$0")" && pwd)"

fail() { echo "wheelhouse: $1" >&2; exit 1; }

"$PYTHON" -c 'import platform, sys
ok = sys.version_info[:2] == (3, 11) and sys.platform == "linux" and platform.machine() == "x86_64"
sys.exit(0 if ok else 1)' || fail "the image is CPython 3.11 on x86_64 Linux; run with PYTHON=<such an interpreter>. \
Received: $("$PYTHON" -c 'import platform, sys; print(sys.version.split()[0], sys.platform, platform.machine())' 2>&1)"
"$PYTHON" -m pip --version >/dev/null 2>&1 || fail "$PYTHON has no pip: install python3-pip. Received: PYTHON=$PYTHON"

REQS="$(TORCH_VERSION="$TORCH_VERSION" "$PYTHON" "$HERE/requirements.py")"
if [ -f "$OUT/requirements.txt" ] && [ "$(cat "$OUT/requirements.txt")" = "$REQS" ] && [ -f "$OUT/.complete" ]; then
    echo "wheelhouse: $OUT is complete for this requirement list ($(ls "$OUT"/*.whl | wc -l) wheels); rm -r $OUT to refresh"
    exit 0
fi

TMP="$OUT.tmp"
rm -rf "$TMP" && mkdir -p "$TMP"
printf '%s\n' "$REQS" > "$TMP/requirements.txt"
pip_download() { "$PYTHON" -m pip download --quiet --only-binary=:all: --dest "$TMP" "$@"; }
# shellcheck disable=SC2086  # TORCH_PIP_ARGS is a list of pip arguments
pip_download --no-deps "torch==$TORCH_VERSION" $TORCH_PIP_ARGS
pip_download --find-links "$TMP" -r "$TMP/requirements.txt"
pip_download --no-deps "openmined-psi==2.0.6"
touch "$TMP/.complete"
rm -rf "$OUT" && mv "$TMP" "$OUT"
echo "wheelhouse: $(ls "$OUT"/*.whl | wc -l) wheels, $(du -sh "$OUT" | cut -f1) in $OUT ($(ls "$OUT" | grep '^torch-'))"
