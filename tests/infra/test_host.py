"""After rollout: the host runs the verified kernel, command line and runtime settings.

Everything is read from the running host (/proc, /sys, GRUB's files) and compared with
what the rtfleet_host role recorded in /etc/rtfleet/{plan,host}.json, with the collection's
own parsers (module_utils boot and topology, which the modules run) doing the reading on the
controller. Run with --sudo: GRUB's menu is readable by root only.
"""

from __future__ import annotations

import json

from rtfleet_infra import read_files

from ansible_collections.rtfleet.fleet.plugins.module_utils.boot import (
    HUGEPAGE_KB,
    isolation_expected,
    kernel_entry,
    parse_grub_cfg,
    parse_grubenv,
    split_cmdline,
)
from ansible_collections.rtfleet.fleet.plugins.module_utils.cpulist import parse_cpulist

_BOOT = (
    "/proc/sys/kernel/osrelease",
    "/sys/kernel/realtime",
    "/proc/cmdline",
    "/sys/devices/system/cpu/isolated",
    "/sys/devices/system/cpu/nohz_full",
    "/sys/kernel/mm/transparent_hugepage/enabled",
    "/boot/grub/grub.cfg",
    "/boot/grub/grubenv",
    "/run/rtfleet/tune-state.json",
)


def _boot(host):
    return read_files(host, *_BOOT)


def test_boot_was_verified(rtfleet_host_config):
    assert rtfleet_host_config["boot"] == "verified", "not verified yet: reboot and rerun the role"


def test_running_kernel_is_the_flavour(host, rtfleet_host_config):
    files = _boot(host)
    assert files["/proc/sys/kernel/osrelease"].strip() == rtfleet_host_config["kernel_release"]
    is_rt = (files["/sys/kernel/realtime"] or "").strip() == "1"
    assert is_rt == (rtfleet_host_config["kernel_flavour"] == "rt")


def test_kernel_command_line_has_every_argument(host, rtfleet_host_config):
    running = set(split_cmdline(_boot(host)["/proc/cmdline"]))
    missing = [a for a in rtfleet_host_config["kernel_args"] if a not in running]
    assert not missing, "missing from /proc/cmdline: %s" % " ".join(missing)


def test_isolated_and_nohz_full_cpus_match_the_plan(host, rtfleet_plan, rtfleet_host_config):
    expected = isolation_expected(rtfleet_host_config["kernel_args"])
    assert expected["nohz_full"] == rtfleet_plan["cpulists"]["isolated"]
    files = _boot(host)
    for name in ("isolated", "nohz_full"):
        have = parse_cpulist((files["/sys/devices/system/cpu/" + name] or "").strip())
        assert have == parse_cpulist(expected[name]), name


def test_grub_default_is_the_verified_entry(host, rtfleet_host_config):
    files = _boot(host)
    assert files["/boot/grub/grub.cfg"] is not None, "cannot read grub.cfg (run with --sudo)"
    entries = parse_grub_cfg(files["/boot/grub/grub.cfg"])
    env = parse_grubenv(files["/boot/grub/grubenv"])
    entry = kernel_entry(entries, rtfleet_host_config["kernel_release"])
    assert entry is not None and env.get("saved_entry") == entry["id_path"]
    assert not [a for a in rtfleet_host_config["kernel_args"] if a not in entry["args"]]
    assert not env.get("next_entry"), "a one-shot boot is still pending"
    assert not [e for e in entries if e["id"] == "rtfleet-trial"], "the trial entry is left behind"


def test_sysctls(host, rtfleet_host_config):
    wanted = rtfleet_host_config["sysctls"]
    paths = {key: "/proc/sys/" + key.replace(".", "/") for key in sorted(wanted)}
    files = read_files(host, *paths.values())
    for key, path in paths.items():
        if files[path] is not None:  # rtfleet-host-tune reports the ones a kernel lacks
            assert files[path].split() == str(wanted[key]).split(), key


def test_transparent_hugepages_off(host):
    enabled = _boot(host)["/sys/kernel/mm/transparent_hugepage/enabled"]
    # PREEMPT_RT kernels are built without THP at all, which is as good.
    assert enabled is None or "[never]" in enabled


def test_hugepages_per_node(host, rtfleet_plan, rtfleet_host_config):
    pages = rtfleet_host_config["hugepages"]
    size_kb = HUGEPAGE_KB[pages["size"]]
    per_node = pages["per_node"]
    paths = {
        node["id"]: "/sys/devices/system/node/node%d/hugepages/hugepages-%dkB/nr_hugepages"
        % (node["id"], size_kb)
        for node in rtfleet_plan["numa_nodes"]
    }
    files = read_files(host, *paths.values())
    for node, path in paths.items():
        want = per_node.get(str(node), 0) if isinstance(per_node, dict) else per_node
        assert int(files[path]) == int(want), path


def test_irqs_stay_off_the_isolated_cpus(host, rtfleet_plan, rtfleet_host_config):
    if rtfleet_host_config["irq_mode"] != "static":
        assert host.service("irqbalance").is_running
        return
    housekeeping = set(rtfleet_plan["housekeeping"])
    unmovable = set(json.loads(_boot(host)["/run/rtfleet/tune-state.json"])["unmovable"])
    stray = []
    for path, content in read_files(host, "/proc/irq/*/smp_affinity_list").items():
        irq = int(path.split("/")[3])
        cpus = set(parse_cpulist(content.strip()))
        if irq not in unmovable and not cpus <= housekeeping:
            stray.append("%d -> %s" % (irq, sorted(cpus)))
    assert not stray, "IRQs allowed on isolated CPUs: %s" % ", ".join(stray)
    assert not host.service("irqbalance").is_running


def test_tuning_service_ran_at_boot(host):
    result = host.run("systemctl show -p UnitFileState -p Result rtfleet-host-tune.service")
    assert sorted(result.stdout.split()) == ["Result=success", "UnitFileState=enabled"]


# One shell round trip: a transient service in system.slice reports the CPUs it may use and
# tries to pin itself to a runtime CPU; a process moved from system.slice into kubepods.slice
# (what runc does when it starts a pod's container) reports the CPUs it gets there. No kubelet
# runs in the lab: kubepods.slice is the slice kubelet's systemd cgroup driver creates.
_SLICE_PROBE = r"""
set -u
probe() { systemd-run --quiet --wait --pipe --collect "$@"; }
echo "system=$(probe -p Slice=system.slice grep Cpus_allowed_list /proc/self/status | cut -f2)"
if probe -p Slice=system.slice taskset -c %(runtime_cpu)s true 2>/dev/null; then
  echo pin=allowed; else echo pin=refused; fi
unit=rtfleet-probe-$$
systemd-run --quiet --unit "$unit" -p Slice=system.slice sleep 30
pid=$(systemctl show -P MainPID "$unit")
systemctl start kubepods.slice 2>/dev/null || systemd-run --quiet -p Slice=kubepods.slice true
mkdir -p /sys/fs/cgroup/kubepods.slice/rtfleet-probe
echo "$pid" > /sys/fs/cgroup/kubepods.slice/rtfleet-probe/cgroup.procs
echo "moved=$(grep Cpus_allowed_list /proc/$pid/status | cut -f2)"
kill "$pid"; sleep 0.2; rmdir /sys/fs/cgroup/kubepods.slice/rtfleet-probe
"""


def test_system_services_stay_off_runtime_and_pod_cpus(host, rtfleet_plan):
    runtime = rtfleet_plan["runtime"]
    out = host.run(_SLICE_PROBE % {"runtime_cpu": runtime[0]})
    seen = dict(line.split("=", 1) for line in out.stdout.split() if "=" in line)
    housekeeping = set(rtfleet_plan["housekeeping"])
    assert set(parse_cpulist(seen["system"])) <= housekeeping, out.stdout + out.stderr
    assert seen["pin"] == "refused", "a system.slice process could pin itself to a runtime CPU"
    # A pod's container is not held to system.slice's CPUs (the CPUAffinity= leak).
    moved = set(parse_cpulist(seen["moved"]))
    assert set(rtfleet_plan["pod_pool"]) <= moved, out.stdout + out.stderr


def test_slice_dropins_hold_the_housekeeping_cpus(host, rtfleet_plan):
    for unit in ("system.slice", "user.slice", "init.scope"):
        # systemctl prints the ranges space-separated ("0-1 12-13")
        allowed = host.run("systemctl show -P AllowedCPUs %s", unit).stdout.split()
        assert parse_cpulist(",".join(allowed)) == rtfleet_plan["housekeeping"], unit
