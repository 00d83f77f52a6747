"""After rollout: the host runs the verified kernel, command line and runtime settings.

Everything is read from the running host (/proc, /sys, GRUB's files) and compared with
what the rtfleet_host role recorded in /etc/rtfleet/{plan,host}.json, with rtfleet's own
parsers (rtfleet.boot, rtfleet.topology) doing the reading on the controller.
"""

from __future__ import annotations

import json

from rtfleet.boot import (
    isolation_expected,
    kernel_entry,
    parse_grub_cfg,
    parse_grubenv,
    split_cmdline,
)
from rtfleet.topology import parse_cpulist


def _read(host, path):
    return host.file(path).content_string.strip()


def test_boot_was_verified(rtfleet_host_config):
    assert rtfleet_host_config["boot"] == "verified", (
        "the new boot is not verified yet: reboot and rerun the role"
    )


def test_running_kernel_is_the_flavour(host, rtfleet_host_config):
    assert _read(host, "/proc/sys/kernel/osrelease") == rtfleet_host_config["kernel_release"]
    realtime = host.file("/sys/kernel/realtime")
    is_rt = realtime.exists and realtime.content_string.strip() == "1"
    assert is_rt == (rtfleet_host_config["kernel_flavour"] == "rt")


def test_kernel_command_line_has_every_argument(host, rtfleet_host_config):
    running = set(split_cmdline(_read(host, "/proc/cmdline")))
    missing = [a for a in rtfleet_host_config["kernel_args"] if a not in running]
    assert not missing, "missing from /proc/cmdline: %s" % " ".join(missing)


def test_isolated_and_nohz_full_cpus_match_the_plan(host, rtfleet_plan, rtfleet_host_config):
    expected = isolation_expected(rtfleet_host_config["kernel_args"])
    assert expected["nohz_full"] == rtfleet_plan["cpulists"]["isolated"]
    for name in ("isolated", "nohz_full"):
        have = parse_cpulist(_read(host, "/sys/devices/system/cpu/" + name) or "")
        assert have == parse_cpulist(expected[name]), name


def test_grub_default_is_the_verified_entry(host, rtfleet_host_config):
    entries = parse_grub_cfg(host.file("/boot/grub/grub.cfg").content_string)
    env = parse_grubenv(host.file("/boot/grub/grubenv").content_string)
    entry = kernel_entry(entries, rtfleet_host_config["kernel_release"])
    assert entry is not None and env.get("saved_entry") == entry["id_path"]
    assert not [a for a in rtfleet_host_config["kernel_args"] if a not in entry["args"]]
    assert not env.get("next_entry"), "a one-shot boot is still pending"
    assert not [e for e in entries if e["id"] == "rtfleet-trial"], "the trial entry was left behind"


def test_sysctls(host, rtfleet_host_config):
    for key, value in rtfleet_host_config["sysctls"].items():
        path = "/proc/sys/" + key.replace(".", "/")
        if host.file(path).exists:  # rtfleet-host-tune reports the ones a kernel lacks
            assert " ".join(_read(host, path).split()) == " ".join(str(value).split()), key


def test_transparent_hugepages_off(host, rtfleet_host_config):
    assert "[never]" in _read(host, "/sys/kernel/mm/transparent_hugepage/enabled")


def test_hugepages_per_node(host, rtfleet_plan, rtfleet_host_config):
    pages = rtfleet_host_config["hugepages"]
    size_kb = {"2M": 2048, "1G": 1048576}[pages["size"]]
    for node in rtfleet_plan["numa_nodes"]:
        per_node = pages["per_node"]
        want = per_node.get(str(node["id"]), 0) if isinstance(per_node, dict) else per_node
        path = "/sys/devices/system/node/node%d/hugepages/hugepages-%dkB/nr_hugepages" % (
            node["id"],
            size_kb,
        )
        assert int(_read(host, path)) == int(want), path


def test_irqs_stay_off_the_isolated_cpus(host, rtfleet_plan, rtfleet_host_config):
    if rtfleet_host_config["irq_mode"] != "static":
        assert host.service("irqbalance").is_running
        return
    housekeeping = set(rtfleet_plan["housekeeping"])
    state = json.loads(host.file("/run/rtfleet/tune-state.json").content_string)
    unmovable = set(state["unmovable"])
    stray = []
    for irq in host.file("/proc/irq").listdir():
        if not irq.isdigit() or int(irq) in unmovable:
            continue
        cpus = set(parse_cpulist(_read(host, "/proc/irq/%s/smp_affinity_list" % irq)))
        if not cpus <= housekeeping:
            stray.append("%s -> %s" % (irq, sorted(cpus)))
    assert not stray, "IRQs allowed on isolated CPUs: %s" % ", ".join(stray)
    assert not host.service("irqbalance").is_running


def test_tuning_service_ran_at_boot(host):
    service = host.service("rtfleet-host-tune")
    assert service.is_enabled
    result = host.run("systemctl show -p Result --value rtfleet-host-tune.service")
    assert result.stdout.strip() == "success"
