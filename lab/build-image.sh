#!/bin/bash
# Build the rtfleet lab base image: Debian 12 (bookworm) with the stock and the RT kernel,
# booting through its own GRUB, for disposable QEMU hosts (`rtfleet lab up`).
#
#   lab/build-image.sh [--force] [--print-path]
#
# The image lands in ${RTFLEET_CACHE_DIR:-$HOME/.cache/rtfleet}/images/ named after a hash
# of this script and lab/image/ (package list + files copied into the guest), so it is
# rebuilt only when those change. rtfleet.lab.image_path() computes the same hash.
#
# Why it is built this way (see lab/README.md):
#   * Debian packages only: mmdebstrap --variant=minbase into a directory.
#   * No loop devices (this kernel has no loop partitions): the disk is a plain file with an
#     MBR from sfdisk and an ext4 made by `mkfs.ext4 -E offset= -d rootfs`.
#   * One boot of the image itself, with QEMU's -kernel/-initrd, runs grub-install,
#     update-grub and apt-get update inside (rtfleet-lab-firstboot), so the host needs no
#     GRUB tools and the result boots through real GRUB like a real machine.
#   * No ssh key is baked in: `rtfleet lab up` hands each host the lab key via QEMU fw_cfg.
set -euo pipefail

LAB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SUITE=bookworm
MIRROR=http://deb.debian.org/debian
SECURITY_MIRROR=http://deb.debian.org/debian-security
DISK_SIZE_MIB=8192
PART_OFFSET_MIB=1
FIRSTBOOT_TIMEOUT_S=${RTFLEET_FIRSTBOOT_TIMEOUT:-1200}

force=0
print_path=0
for arg in "$@"; do
    case "$arg" in
        --force) force=1 ;;
        --print-path) print_path=1 ;;
        -h|--help) sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build-image.sh: unknown argument: $arg" >&2; exit 2 ;;
    esac
done

log() { printf '[build-image %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf 'build-image.sh: error: %s\n' "$*" >&2; exit 1; }

# The hash covers every input by relative path and content, sorted; keep in step with
# rtfleet.lab.image_hash().
image_hash() {
    (
        cd "$LAB_DIR"
        find build-image.sh image -type f -print0 | LC_ALL=C sort -z |
            while IFS= read -r -d '' f; do
                printf '%s\0' "$f"
                cat "$f"
                printf '\0'
            done
    ) | sha256sum | cut -c1-12
}

cache_dir=${RTFLEET_CACHE_DIR:-$HOME/.cache/rtfleet}
images_dir=$cache_dir/images
hash=$(image_hash)
image=$images_dir/debian12-rtfleet-$hash.qcow2

if (( print_path )); then
    echo "$image"
    exit 0
fi

missing=()
for tool in qemu-system-x86_64:qemu-system-x86 qemu-img:qemu-utils mmdebstrap:mmdebstrap \
            sfdisk:fdisk mkfs.ext4:e2fsprogs flock:util-linux; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool#*:}")
done
if (( ${#missing[@]} )); then
    die "missing tools; install them with: apt-get install ${missing[*]}"
fi
if (( EUID != 0 )); then
    die "run as root: mmdebstrap needs root to build a rootfs owned by root for mkfs.ext4 -d"
fi

mkdir -p "$images_dir"
# One build at a time per cache dir; a second caller waits and then finds the image.
exec 9>"$images_dir/.build.lock"
flock 9

if [[ -e "$image" && $force -eq 0 ]]; then
    log "image up to date: $image"
    echo "$image"
    exit 0
fi

work=$(mktemp -d "$images_dir/.build-$hash.XXXXXX")
cleanup() {
    if [[ -n "${qemu_pid:-}" ]] && kill -0 "$qemu_pid" 2>/dev/null; then
        kill "$qemu_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

start=$SECONDS
rootfs=$work/rootfs
packages=$(grep -v '^\s*#' "$LAB_DIR/image/packages.txt" | tr -s ' \n' ',' | sed 's/^,//;s/,$//')

log "mmdebstrap $SUITE (minbase + ${packages//,/ })"
mmdebstrap --variant=minbase --components=main \
    --include="$packages" \
    --aptopt='Acquire::Retries "3"' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    "$SUITE" "$rootfs" \
    "deb $MIRROR $SUITE main" \
    "deb $MIRROR $SUITE-updates main" \
    "deb $SECURITY_MIRROR $SUITE-security main" >&2
log "rootfs done after $((SECONDS - start)) s"

root_uuid=$(cat /proc/sys/kernel/random/uuid)

log "customising rootfs"
cp -a "$LAB_DIR/image/overlay/." "$rootfs/"
chown -R root:root "$rootfs/etc/systemd/system/rtfleet-lab-"* "$rootfs/usr/local/sbin/rtfleet-lab-"* \
    "$rootfs/etc/sudoers.d/lab" "$rootfs/etc/ssh/sshd_config.d/rtfleet-lab.conf" \
    "$rootfs/etc/systemd/network/20-lab-dhcp.network"
chmod 0440 "$rootfs/etc/sudoers.d/lab"
printf 'UUID=%s / ext4 errors=remount-ro 0 1\n' "$root_uuid" > "$rootfs/etc/fstab"
echo rtfleet-lab > "$rootfs/etc/hostname"
printf '127.0.0.1\tlocalhost\n127.0.1.1\trtfleet-lab\n' > "$rootfs/etc/hosts"
# QEMU user networking's resolver; static so it does not depend on systemd-resolved.
echo 'nameserver 10.0.2.3' > "$rootfs/etc/resolv.conf"
chroot "$rootfs" useradd --create-home --shell /bin/bash --user-group lab
chroot "$rootfs" usermod --password '*' lab
rm -f "$rootfs"/etc/ssh/ssh_host_*
chroot "$rootfs" systemctl enable systemd-networkd.service rtfleet-lab-init.service \
    rtfleet-lab-firstboot.service >&2
# Timers that grab the dpkg lock in the middle of a converge make tests flaky.
chroot "$rootfs" systemctl mask apt-daily.timer apt-daily-upgrade.timer >&2
# GRUB as a real host has it: settings in /etc/default/grub, which roles edit later.
sed -i \
    -e 's/^GRUB_DEFAULT=.*/GRUB_DEFAULT=saved/' \
    -e 's/^GRUB_TIMEOUT=.*/GRUB_TIMEOUT=1/' \
    -e 's/^GRUB_CMDLINE_LINUX_DEFAULT=.*/GRUB_CMDLINE_LINUX_DEFAULT=""/' \
    -e 's/^GRUB_CMDLINE_LINUX=.*/GRUB_CMDLINE_LINUX="console=ttyS0,115200"/' \
    "$rootfs/etc/default/grub"
cat >> "$rootfs/etc/default/grub" <<'EOF'

# rtfleet lab: a flat menu so entries are addressed by title (grub-set-default, grub-reboot),
# and the menu on the serial console that QEMU logs.
GRUB_DISABLE_SUBMENU=y
GRUB_TERMINAL="console serial"
GRUB_SERIAL_COMMAND="serial --unit=0 --speed=115200"
EOF

stock_kernel=$(find "$rootfs/boot" -maxdepth 1 -name 'vmlinuz-*-amd64' ! -name '*-rt-*' -printf '%f\n' |
    sed 's/^vmlinuz-//' | sort -V | tail -n1)
rt_kernel=$(find "$rootfs/boot" -maxdepth 1 -name 'vmlinuz-*-rt-amd64' -printf '%f\n' |
    sed 's/^vmlinuz-//' | sort -V | tail -n1)
[[ -n "$stock_kernel" && -n "$rt_kernel" ]] || die "kernels missing from rootfs/boot"
grep -q '^CONFIG_FW_CFG_SYSFS=[ym]' "$rootfs/boot/config-$stock_kernel" ||
    die "kernel $stock_kernel lacks CONFIG_FW_CFG_SYSFS; ssh key injection would not work"
cp "$rootfs/boot/vmlinuz-$stock_kernel" "$rootfs/boot/initrd.img-$stock_kernel" "$work/"
{
    echo "hash=$hash"
    echo "suite=$SUITE"
    echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "stock_kernel=$stock_kernel"
    echo "rt_kernel=$rt_kernel"
    echo "root_uuid=$root_uuid"
    echo "# dpkg-query -W"
    chroot "$rootfs" dpkg-query -W
} > "$work/manifest"

log "making the disk (${DISK_SIZE_MIB} MiB, MBR, ext4 at ${PART_OFFSET_MIB} MiB)"
disk=$work/disk.raw
truncate -s "${DISK_SIZE_MIB}M" "$disk"
printf 'label: dos\nstart=%dMiB, type=83, bootable\n' "$PART_OFFSET_MIB" | sfdisk -q "$disk"
mkfs.ext4 -q -F -L rtfleet-root -U "$root_uuid" \
    -E "offset=$((PART_OFFSET_MIB * 1024 * 1024))" -d "$rootfs" \
    "$disk" "$(( (DISK_SIZE_MIB - PART_OFFSET_MIB) * 1024 ))k"
rm -rf "$rootfs"

log "first boot under QEMU (grub-install, update-grub, apt-get update); serial log: $work/firstboot.log"
serial=$work/firstboot.log
qemu-system-x86_64 \
    -name rtfleet-lab-image-build \
    -machine q35 -accel tcg,thread=multi -cpu EPYC,check=off -smp 2 -m 2048 \
    -drive "file=$disk,format=raw,if=virtio,cache=unsafe,discard=unmap" \
    -nic user,model=virtio-net-pci \
    -kernel "$work/vmlinuz-$stock_kernel" -initrd "$work/initrd.img-$stock_kernel" \
    -append "root=/dev/vda1 rw console=ttyS0,115200" \
    -serial "file:$serial" -display none -no-reboot -monitor none &
qemu_pid=$!
deadline=$((SECONDS + FIRSTBOOT_TIMEOUT_S))
while kill -0 "$qemu_pid" 2>/dev/null; do
    if (( SECONDS > deadline )); then
        kill "$qemu_pid"
        tail -n 40 "$serial" >&2 || true
        die "first boot did not finish within ${FIRSTBOOT_TIMEOUT_S} s (serial log tail above)"
    fi
    sleep 2
done
wait "$qemu_pid" || true
qemu_pid=
cp "$serial" "$images_dir/debian12-rtfleet-$hash.firstboot.log"
if ! grep -q 'RTFLEET-FIRSTBOOT-OK' "$serial"; then
    tail -n 40 "$serial" >&2 || true
    die "first boot failed (serial log tail above; full log: $images_dir/debian12-rtfleet-$hash.firstboot.log)"
fi
log "first boot done after $((SECONDS - start)) s"

qemu-img convert -f raw -O qcow2 "$disk" "$work/image.qcow2"
mv "$work/manifest" "$images_dir/debian12-rtfleet-$hash.manifest"
mv "$work/image.qcow2" "$image"
log "image ready after $((SECONDS - start)) s: $image ($(du -h "$image" | cut -f1))"
echo "$image"
