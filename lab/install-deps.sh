#!/bin/bash
# Install the Debian packages the lab needs on the controller (QEMU, image builder tools),
# only those that are missing. Debian/Ubuntu only; run as root or with sudo available.
set -euo pipefail

# rt-tests: the post-check runner test (tests/unit/test_postcheck_runner.py) runs cyclictest here.
# gcc, python3-dev: shminfer's optional C hot path (src/shminfer/_fast.c), built by make setup.
packages=(qemu-system-x86 qemu-utils mmdebstrap e2fsprogs fdisk util-linux openssh-client rt-tests
    gcc python3-dev)
# QEMU older than this boots the server-shaped guest (48 vCPUs, a TCG thread each) into a
# PREEMPT_RT kernel unreliably: QEMU 7.2 (Debian 12) hung 3 of 8 such boots in a
# cross-modifying-code race (docs/dev/runs.md). On Debian 12 the newer QEMU comes from
# bookworm-backports, an official Debian archive that apt pins below the release (priority
# 100), so only the packages asked for with -t come from it.
qemu_min_major=10  # rtfleet.lab.QEMU_RELIABLE_MAJOR warns from the same figure
qemu_from_backports=(qemu-system-x86 qemu-utils)

sudo=()
(( EUID == 0 )) || sudo=(sudo)

missing=()
for pkg in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
done
if (( ${#missing[@]} == 0 )); then
    echo "lab dependencies present: ${packages[*]}"
else
    echo "installing: ${missing[*]}"
    "${sudo[@]}" apt-get update
    "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
fi

qemu_major() {
    qemu-system-x86_64 --version | sed -n '1s/^QEMU emulator version \([0-9]*\)\..*/\1/p'
}
major=$(qemu_major)
if [[ -z "$major" ]]; then
    echo "error: cannot read the QEMU version from 'qemu-system-x86_64 --version'" >&2
    exit 1
fi
if (( major >= qemu_min_major )); then
    echo "QEMU $major: at least $qemu_min_major"
    exit 0
fi
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
if [[ "$codename" != bookworm ]]; then
    echo "warning: QEMU $major here; the server-shaped lab host needs QEMU $qemu_min_major or newer" \
        "(its RT boots can hang under older TCG, docs/dev/runs.md); install it from your distribution" >&2
    exit 0
fi
list=/etc/apt/sources.list.d/bookworm-backports.sources
if ! grep -rqsE '^[^#]*bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    echo "adding $list (QEMU $major is older than $qemu_min_major)"
    printf '%s\n' 'Types: deb' 'URIs: http://deb.debian.org/debian' 'Suites: bookworm-backports' \
        'Components: main' 'Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg' \
        | "${sudo[@]}" tee "$list" >/dev/null
fi
echo "installing from bookworm-backports: ${qemu_from_backports[*]}"
"${sudo[@]}" apt-get update
"${sudo[@]}" apt-get install -y --no-install-recommends -t bookworm-backports "${qemu_from_backports[@]}"
major=$(qemu_major)
if (( major < qemu_min_major )); then
    echo "error: QEMU is still $major after installing from bookworm-backports" >&2
    exit 1
fi
echo "QEMU $major from bookworm-backports"
