#!/usr/bin/env bash
# Make a Python 3.11 base image from Debian packages, for machines that reach no image registry
# (the fully air-gapped path of docs/deployment.md):
#
#   docker/base-image.sh [IMAGE]        # default fedsplit-base:bookworm
#
# debootstrap (--variant=minbase) builds a Debian root file system with python3, python3-venv,
# python3-pip, ca-certificates and nginx-light (the coordinator's front proxy, compose.tls.yaml)
# from the Debian mirror apt on this machine already uses (read from /etc/apt/sources.list*; set
# DEBIAN_MIRROR to override), and `docker import` turns it into an image. The root file system
# tarball is kept in $FEDSPLIT_CACHE (default build/containers, git-ignored), named after the
# package list: a second run on the same machine only re-imports it. Needs root and debootstrap.
set -euo pipefail

IMAGE="${1:-fedsplit-base:bookworm}"
SUITE="${DEBIAN_SUITE:-bookworm}"
CACHE="${FEDSPLIT_CACHE:-build/containers}"
PACKAGES="python3,python3-venv,python3-pip,ca-certificates,nginx-light"
# another package list is another root file system: never reuse a tarball made without one
TARBALL="$CACHE/base-$SUITE-$(printf '%s' "$PACKAGES" | sha256sum | cut -c1-12).tar"

fail() { echo "base-image: $1" >&2; exit 1; }

# The first Debian archive URI of apt's sources (deb822 "URIs:" or one-line "deb URI SUITE ...").
apt_mirror() {
    local files=(/etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list)
    local f uri
    for f in "${files[@]}"; do
        [ -f "$f" ] || continue
        uri=$(awk '
            /^[[:space:]]*#/ { next }
            /^URIs:/ { for (i = 2; i <= NF; i++) if ($i !~ /security/) { print $i; exit } }
            /^deb[[:space:]]/ { u = ($2 ~ /^\[/) ? $3 : $2; if (u !~ /security/) { print u; exit } }
        ' "$f")
        if [ -n "$uri" ]; then echo "$uri"; return 0; fi
    done
    return 1
}

command -v docker >/dev/null || fail "no docker client on PATH: install docker.io. Received: PATH=$PATH"

if [ ! -s "$TARBALL" ]; then
    [ "$(id -u)" = 0 ] || fail "debootstrap needs root: run as root or with sudo. Received: uid $(id -u)"
    command -v debootstrap >/dev/null \
        || fail "debootstrap is not installed: apt-get install debootstrap. Received: PATH=$PATH"
    MIRROR="${DEBIAN_MIRROR:-$(apt_mirror)}" \
        || fail "no Debian mirror in /etc/apt/sources.list*: set DEBIAN_MIRROR=URL. Received: nothing"
    mkdir -p "$CACHE"
    ROOTFS=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    trap 'rm -rf "$ROOTFS"' EXIT
    echo "base-image: debootstrap $SUITE ($PACKAGES) from the apt mirror into $ROOTFS"
    rc=0
    debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 || rc=$?
    if [ "$rc" != 0 ]; then
        tail -20 "$CACHE/debootstrap.log" >&2
        fail "debootstrap failed; its log: $CACHE/debootstrap.log. Received: exit $rc"
    fi
    # Smaller image: no apt lists, caches, docs or man pages are needed at run time.
    rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/cache/apt/archives/*.deb \
           "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/locale/*
    tar -C "$ROOTFS" --numeric-owner -cf "$TARBALL.tmp" .
    mv "$TARBALL.tmp" "$TARBALL"
else
    echo "base-image: reusing $TARBALL"
fi

docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    "$TARBALL" "$IMAGE" >/dev/null
docker run --rm --network none "$IMAGE" python3 -c 'import sys, venv, ssl; print("base-image: '"$IMAGE"' has Python", sys.version.split()[0])'
docker run --rm --network none "$IMAGE" nginx -v
