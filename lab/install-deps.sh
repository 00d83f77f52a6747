#!/bin/bash
# Install the Debian packages the lab needs on the controller (QEMU, image builder tools),
# only those that are missing. Debian/Ubuntu only; run as root or with sudo available.
set -euo pipefail

# rt-tests: the post-check runner test (tests/unit/test_postcheck_runner.py) runs cyclictest here.
# gcc, python3-dev: shminfer's optional C hot path (src/shminfer/_fast.c), built by make setup.
packages=(qemu-system-x86 qemu-utils mmdebstrap e2fsprogs fdisk util-linux openssh-client rt-tests
    gcc python3-dev)
missing=()
for pkg in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
done
if (( ${#missing[@]} == 0 )); then
    echo "lab dependencies present: ${packages[*]}"
    exit 0
fi
sudo=()
(( EUID == 0 )) || sudo=(sudo)
echo "installing: ${missing[*]}"
"${sudo[@]}" apt-get update
"${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
