#!/bin/bash
# Capture the sysfs/procfs files rtfleet's topology parser reads, as a tar.gz whose paths are
# relative to / (sys/..., proc/...). Runs on any Linux host, no root needed; operators attach
# the tarball to bug reports and tests use it as a fixture (tests/fixtures/sysfs/).
#
#   capture-sysfs.sh [OUTPUT.tar.gz]        (default: write the tarball to stdout)
#   rtfleet lab ssh HOST -- bash -s < lab/capture-sysfs.sh > HOST.tar.gz
#
# Files are copied by reading them (sysfs reports 4096 bytes for everything, so tar cannot
# archive it directly) and symlinks such as /sys/class/dmi/id become real directories.
set -euo pipefail

out=${1:--}
if [[ "$out" == -h || "$out" == --help ]]; then
    sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

cpu=/sys/devices/system/cpu
node=/sys/devices/system/node
patterns=(
    "$cpu"/{online,possible,present,offline,isolated,nohz_full,kernel_max}
    "$cpu"/smt/{control,active}
    "$cpu"/cpu[0-9]*/topology/*
    "$cpu"/cpu[0-9]*/cache/index[0-9]*/{level,type,shared_cpu_list,shared_cpu_map,id,size}
    "$cpu"/cpu[0-9]*/online
    "$node"/{online,possible,has_cpu,has_normal_memory}
    "$node"/node[0-9]*/{cpulist,cpumap,meminfo,distance}
    /sys/kernel/realtime
    /sys/class/dmi/id/{sys_vendor,product_name,board_vendor,bios_vendor}
    /sys/hypervisor/type
    /proc/cpuinfo /proc/cmdline /proc/version /proc/sys/kernel/osrelease
)

shopt -s nullglob
for path in "${patterns[@]}"; do
    # Unexpanded globs and absent optional files (realtime, hypervisor, cpu0/online) are skipped.
    [[ -f "$path" && -r "$path" ]] || continue
    dest=$tmp${path}
    mkdir -p "${dest%/*}"
    cat -- "$path" > "$dest" 2>/dev/null || rm -f "$dest"
done

top=()
for entry in "$tmp"/*; do top+=("${entry##*/}"); done
tar_args=(-C "$tmp" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - "${top[@]}")
if [[ "$out" == - ]]; then
    tar "${tar_args[@]}" | gzip -n
else
    tar "${tar_args[@]}" | gzip -n > "$out"
fi
