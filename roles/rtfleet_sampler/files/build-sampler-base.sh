#!/bin/bash
# Build the base of the lab's sampler container image: a Debian 12 (bookworm) root file
# system with Python, as a tar (no registry anywhere).
#
#   build-sampler-base.sh [--force] [DIR]
#
# Prints the tar's path. It lands in DIR (default ${RTFLEET_CACHE_DIR:-$HOME/.cache/rtfleet}/images),
# named after a hash of this script, and is rebuilt only when the script changes. The
# sampler image itself (this base + the runtime's own wheels) is built from it on the
# controller too (rtfleet.fleet.sampler_image, the rtfleet_sampler role's container entry
# point); Debian packages only, like the lab's VM image (lab/build-image.sh).
set -euo pipefail

SUITE=bookworm
MIRROR=http://deb.debian.org/debian
SECURITY_MIRROR=http://deb.debian.org/debian-security
PACKAGES=python3,python3-venv

force=0
images_dir=${RTFLEET_CACHE_DIR:-$HOME/.cache/rtfleet}/images
for arg in "$@"; do
    case "$arg" in
        --force) force=1 ;;
        -h|--help) sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "build-sampler-base.sh: unknown option: $arg" >&2; exit 2 ;;
        *) images_dir=$arg ;;
    esac
done

command -v mmdebstrap >/dev/null || {
    echo "build-sampler-base.sh: error: mmdebstrap is missing (make deps installs it)" >&2
    exit 1
}
hash=$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-12)
out=$images_dir/sampler-base-$SUITE-$hash.tar
mkdir -p "$images_dir"
exec 9>"$images_dir/.sampler-base.lock"
flock 9  # one build at a time; a second caller waits, then finds the tar
if [[ $force -eq 1 || ! -s $out ]]; then
    start=$SECONDS
    echo "[build-sampler-base] mmdebstrap $SUITE (minbase + ${PACKAGES//,/ })" >&2
    mmdebstrap --variant=minbase --components=main --format=tar \
        --include="$PACKAGES" \
        --aptopt='Acquire::Retries "3"' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        "$SUITE" "$out.tmp" \
        "deb $MIRROR $SUITE main" \
        "deb $MIRROR $SUITE-updates main" \
        "deb $SECURITY_MIRROR $SUITE-security main" >&2
    mv "$out.tmp" "$out"
    echo "[build-sampler-base] $out in $((SECONDS - start)) s" >&2
fi
echo "$out"
